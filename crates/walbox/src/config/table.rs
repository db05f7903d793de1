//! Every setting, once: its name, its kind, which commands read it, its
//! default and its meaning. The file key, the `WALBOX_*` variable and the
//! flag all derive from the name, `--help` and `walbox config` are built from
//! this table, and a test checks `docs/configuration.md` against it.

/// What a setting's value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Text.
    Text,
    /// A whole number.
    Number,
    /// One of a few words.
    Choice(&'static [&'static str]),
    /// `true` or `false`.
    Bool,
    /// `KEY=VALUE` pairs: a table in the file, repeatable flag, `K=V,K=V` in
    /// the environment.
    Map,
}

/// Which commands read a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// Every command: where Postgres is, which slot, publication and table.
    Connection,
    /// Commands that check or map the outbox's columns.
    Mapping,
    /// `walbox run`.
    Run,
}

/// The `--help` heading of the settings of a running process, listed last.
pub const RUNNING: &str = "Running (limits, recovery, observability)";

/// One setting.
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    /// The file key (`section.key` for nested ones).
    pub key: &'static str,
    /// Its kind.
    pub kind: Kind,
    /// Who reads it.
    pub scope: Scope,
    /// The default, as documented (`—` for none).
    pub default: &'static str,
    /// A secret: never printed.
    pub secret: bool,
    /// For `--help` and the docs.
    pub doc: &'static str,
    /// For a map, the flag's singular name (`--kafka-property`).
    pub flag_name: Option<&'static str>,
}

impl Setting {
    /// `WALBOX_` and the key, upper case, dots and dashes as underscores.
    pub fn env(&self) -> String {
        format!(
            "WALBOX_{}",
            self.key.replace(['.', '-'], "_").to_uppercase()
        )
    }

    /// The `--help` section the flag is listed under.
    pub fn heading(&self) -> &'static str {
        let k = self.key;
        if matches!(
            k,
            "pg_url"
                | "slot"
                | "publication"
                | "shards"
                | "shard"
                | "table"
                | "source"
                | "message_prefix"
        ) {
            "Postgres and the outbox"
        } else if k.starts_with("mapping.")
            || k == "format"
            || k == "cloudevents_source"
            || k.starts_with("schema_registry.")
        {
            "Records (mapping and format)"
        } else if k == "sink"
            || ["kafka.", "rabbitmq.", "sqs.", "nats.", "webhook."]
                .iter()
                .any(|p| k.starts_with(p))
            || k.starts_with("topics.")
            || k.starts_with("transactions.")
            || k == "dead_letter_topic"
            || k == "on_failure"
            || k.starts_with("quarantine.")
            || k.starts_with("claim_check.")
            || k == "delivery"
        {
            "Brokers and delivery"
        } else {
            RUNNING
        }
    }

    /// The long flag without dashes: the key with dots and underscores as
    /// dashes (a map's is singular).
    pub fn flag(&self) -> String {
        self.flag_name
            .map(str::to_owned)
            .unwrap_or_else(|| self.key.replace(['.', '_'], "-"))
    }
}

const fn s(
    key: &'static str,
    kind: Kind,
    scope: Scope,
    default: &'static str,
    doc: &'static str,
) -> Setting {
    Setting {
        key,
        kind,
        scope,
        default,
        secret: false,
        doc,
        flag_name: None,
    }
}

use Kind::*;
use Scope::*;

/// Every setting.
pub const SETTINGS: &[Setting] = &[
    Setting {
        secret: true,
        ..s("pg_url", Text, Connection, "—",
            "Postgres connection: a URL (postgres://user:pass@host:5432/db?sslmode=verify-full&sslrootcert=ca.pem) or libpq keywords (host=… user=… dbname=…). Required.")
    },
    s("slot", Text, Connection, "walbox",
      "Logical replication slot: 1-63 lower-case letters, digits and underscores."),
    s("publication", Text, Connection, "walbox_outbox", "Publication on the outbox table."),
    s("shards", Number, Connection, "1",
      "Split the outbox over this many slots, each streamed by its own walbox process (Postgres 15+: publication row filters on a hash of the aggregate id, so each aggregate stays in one shard and in order). Shard i's slot and publication are the names above with _i appended (docs/operations.md, \"Sharded streaming\")."),
    s("shard", Number, Connection, "—",
      "With shards > 1: the shard this process streams, 0 to shards - 1 (run needs it; init-slot, status and drop-slot without it act on every shard)."),
    s("table", Text, Connection, "public.outbox_events",
      "The outbox table, schema.table; parts may be \"quoted\". Several: a comma-separated list (an array in the file), where * in a part matches any run of characters (tenant_*.outbox_events: a table per tenant schema); walbox run adds a new matching table to the publication while it has never held a row (docs/configuration.md, \"Several outbox tables\")."),
    s("source", Choice(&["table", "messages", "both"]), Connection, "table",
      "Where events come from: rows inserted into the outbox table; transactional logical decoding messages written with walbox.emit() or pg_logical_emit_message(true, message_prefix, envelope) (Postgres 14+, no table: docs/configuration.md, \"Choosing a source\"); or both."),
    s("log_format", Choice(&["text", "json"]), Connection, "text",
      "Log lines as text or JSON (every line, the last one included); verbosity from WALBOX_LOG, else RUST_LOG (e.g. info, walbox=debug). Colour only on a terminal."),
    s("mapping.preset", Choice(&["walbox", "debezium"]), Mapping, "walbox",
      "Column-name preset: walbox's outbox_events, or Debezium's EventRouter (id, aggregatetype, aggregateid, type, payload)."),
    s("mapping.topic_template", Text, Mapping, "outbox.event.{aggregate_type}",
      "Topic of each event; {aggregate_type} is replaced by the row's aggregate type, {schema} and {table} by its table's (not with source = messages or both)."),
    s("mapping.id", Text, Mapping, "id", "Event id column: header `id`, the consumers' dedup key."),
    s("mapping.aggregate_type", Text, Mapping, "aggregate_type", "Aggregate type column: chooses the topic."),
    s("mapping.aggregate_id", Text, Mapping, "aggregate_id", "Aggregate id column: the message key."),
    s("mapping.event_type", Text, Mapping, "event_type",
      "Event type column: header `event_type`; empty for none."),
    s("mapping.payload", Text, Mapping, "payload",
      "Payload column (json, jsonb, text, varchar or bytea): the message value (what each format accepts: docs/configuration.md, \"Record formats\")."),
    s("mapping.headers", Text, Mapping, "headers",
      "jsonb object column expanded into one header per key; empty for none."),
    s("mapping.timestamp", Text, Mapping, "created_at",
      "Timestamp column: the message timestamp; empty for none."),
    Setting {
        flag_name: Some("mapping-header-column"),
        ..s("mapping.header_columns", Map, Mapping, "—",
            "Extra columns copied into headers: COLUMN=HEADER.")
    },
    s("format", Choice(&["as-stored", "cloudevents-binary", "cloudevents-structured", "debezium", "avro", "json-schema", "protobuf"]), Mapping, "as-stored",
      "The record: the payload as stored with headers id and event_type; CloudEvents 1.0 in binary mode (ce_* headers, the payload as data) or structured mode (a JSON CloudEvent as the value); as Debezium's EventRouter with table.expand.json.payload and the JSON key converter wrote it (the key a JSON string); avro: the JSON payload serialized with its subject's latest Avro schema in a schema registry, in Confluent's wire format (schema_registry.*); json-schema: the JSON payload, validated against its subject's latest JSON Schema, in the same wire format; or protobuf: the JSON payload as a message of its subject's latest .proto file, in the same wire format. docs/configuration.md, \"Record formats\"."),
    s("cloudevents_source", Text, Mapping, "/walbox/{slot}",
      "CloudEvents formats: the events' source attribute (a URI reference)."),
    s("schema_registry.url", Text, Run, "—",
      "format = avro, json-schema or protobuf: the schema registry's Confluent-compatible API, http:// or https:// (Confluent Schema Registry, Apicurio's /apis/ccompat/v7, Karapace, Redpanda). Required with these formats."),
    s("schema_registry.username", Text, Run, "—",
      "format = avro, json-schema or protobuf: the registry's basic-authentication user."),
    Setting {
        secret: true,
        ..s("schema_registry.password", Text, Run, "—",
            "format = avro, json-schema or protobuf: the registry's basic-authentication password (WALBOX_SCHEMA_REGISTRY_PASSWORD_FILE reads it from a file).")
    },
    s("schema_registry.ca_file", Text, Run, "—",
      "format = avro, json-schema or protobuf: PEM certificates to trust for an https registry instead of the system's."),
    s("schema_registry.subject_strategy", Choice(&["topic", "record", "topic-record"]), Run, "topic",
      "format = avro, json-schema or protobuf: the subject whose latest schema serializes an event, as Confluent's strategies name it: <topic>-value; the event type (the record's full name, e.g. shop.OrderPlaced); or <topic>-<event type>. The team registers the schemas, unless schema_registry.schemas = derived."),
    s("schema_registry.schemas", Choice(&["registered", "derived"]), Run, "registered",
      "format = avro or json-schema: use each subject's latest schema, registered by the team; or derive it from the JSON payloads and register it (opt-in): every field optional and nullable, widened as payloads bring new fields or kinds, a new version only then; walbox continues a schema it derived before and refuses a subject whose schema someone else registered (docs/configuration.md, \"Derived schemas\")."),
    s("schema_registry.key", Choice(&["string", "schema"]), Run, "string",
      "format = avro or json-schema: the record key (the aggregate id) as its text, or serialized in the wire format with the latest schema of subject <topic>-key (a string schema; registered by walbox when schemas = derived), as Confluent's key serializers write it: the key bytes, and so the partitions, of a producer that serialized its keys (Debezium with an AvroConverter key converter). Not with format = protobuf or on_failure = quarantine."),
    s("sink", Choice(&["kafka", "rabbitmq", "sqs", "nats", "webhook"]), Run, "kafka",
      "The broker events go to: Apache Kafka (kafka.*), RabbitMQ (rabbitmq.*: AMQP 0-9-1 with publisher confirms; docs/rabbitmq.md), Amazon SQS (sqs.*: SendMessageBatch, FIFO message groups per aggregate; docs/sqs.md), NATS JetStream (nats.*: publish acks, Nats-Msg-Id deduplication; docs/nats.md), or an HTTP endpoint (webhook.*: a signed POST per event, one in flight per aggregate; docs/webhooks.md)."),
    s("kafka.brokers", Text, Run, "—", "Kafka bootstrap servers, host:port,… Required by run with sink = kafka."),
    Setting {
        secret: true,
        ..s("rabbitmq.url", Text, Run, "—",
            "sink = rabbitmq: the broker, amqp://user:password@host:port/vhost, or amqps:// for TLS (port 5671 by default; the vhost percent-encoded, %2F for /). Required with sink = rabbitmq; a secret (WALBOX_RABBITMQ_URL_FILE).")
    },
    Setting {
        secret: true,
        ..s("rabbitmq.password", Text, Run, "—",
            "sink = rabbitmq: the password, instead of the one in rabbitmq.url (which then names only the user): keep the URL in plain configuration and the password in a secret (WALBOX_RABBITMQ_PASSWORD_FILE reads it from a file).")
    },
    s("rabbitmq.ca_file", Text, Run, "—",
      "sink = rabbitmq with amqps://: PEM certificates to trust instead of the system's (a self-run broker's own CA). The broker's certificate must name the URL's host (or rabbitmq.server_name)."),
    s("rabbitmq.cert_file", Text, Run, "—",
      "sink = rabbitmq with amqps://: the client certificate chain (PEM) for a broker that requires one (mutual TLS, the EXTERNAL login aside); with rabbitmq.key_file. Read at each connection, so a renewed certificate is used at the next reconnect."),
    s("rabbitmq.key_file", Text, Run, "—",
      "sink = rabbitmq with amqps://: the client certificate's private key (unencrypted PEM: PKCS#8, PKCS#1 or SEC1)."),
    s("rabbitmq.server_name", Text, Run, "—",
      "sink = rabbitmq with amqps://: the name the broker's certificate is verified against (and sent as SNI) when it is not the URL's host."),
    s("rabbitmq.exchange", Text, Run, "walbox",
      "sink = rabbitmq: the exchange every event is published to, with the event's topic (mapping.topic_template) as its routing key."),
    s("rabbitmq.exchange_type", Text, Run, "topic",
      "sink = rabbitmq: the exchange's type when walbox declares it."),
    s("rabbitmq.declare_exchange", Bool, Run, "true",
      "sink = rabbitmq: declare the exchange (durable) at each connection; false: it must exist."),
    s("rabbitmq.partitions", Number, Run, "1",
      "sink = rabbitmq: above 1, the routing key is <topic>.<n>, n a hash of the aggregate id below this number: bind one queue per n, each with one consumer (single active consumer), for per-aggregate order (docs/rabbitmq.md)."),
    s("rabbitmq.audit_stream", Text, Run, "—",
      "sink = rabbitmq: a stream queue walbox declares (when missing) and binds to the exchange for every routing key (#; a topic or fanout exchange), so that walbox audit can read back what was published without consuming it. It holds what was published since it was declared. Every message then reaches a queue: one no queue of yours is bound for is delivered to the stream, not returned (docs/rabbitmq.md, \"Auditing\")."),
    s("rabbitmq.audit_stream_max_age", Text, Run, "7D",
      "sink = rabbitmq: how long the audit stream keeps messages (its x-max-age when walbox declares it: a number and Y, M, D, h, m or s). A stream that exists is used as it is."),
    Setting {
        secret: true,
        ..s("nats.url", Text, Run, "—",
            "sink = nats: the server, nats://[user:password@|token@]host:port, or tls:// for TLS (port 4222 by default). Each event is published to the subject its topic names (mapping.topic_template), which a JetStream stream must take. Required with sink = nats; a secret (WALBOX_NATS_URL_FILE).")
    },
    s("nats.ca_file", Text, Run, "—",
      "sink = nats with tls://: PEM certificates to trust instead of the system's."),
    s("nats.ack_timeout_ms", Number, Run, "10000",
      "sink = nats: how long a stream's ack may take; past it the session starts again from what was confirmed, and the stream drops the re-sends it has (Nats-Msg-Id)."),
    Setting {
        secret: true,
        ..s("webhook.url", Text, Run, "—",
            "sink = webhook: the endpoint each event is POSTed to, http:// or https:// (a secret: a token in it is never shown; WALBOX_WEBHOOK_URL_FILE). 2xx delivers; 4xx (but 408, 425, 429) refuses for good; 5xx and timeouts are tried again. Required with sink = webhook.")
    },
    Setting {
        secret: true,
        ..s("webhook.secret", Text, Run, "—",
            "sink = webhook: the HMAC-SHA256 key of the Walbox-Signature header (t=<unix seconds>,v1=<hex HMAC of \"<t>.<body>\">); without it requests are unsigned (WALBOX_WEBHOOK_SECRET_FILE).")
    },
    s("webhook.ca_file", Text, Run, "—",
      "sink = webhook with https://: PEM certificates to trust instead of the system's."),
    s("webhook.timeout_ms", Number, Run, "10000",
      "sink = webhook: how long one request may take before it is tried again."),
    s("webhook.concurrency", Number, Run, "16",
      "sink = webhook: aggregates with a request out at once (1 to 256); each aggregate's events go one after another."),
    s("sqs.queue_url", Text, Run, "—",
      "sink = sqs: the events' queue, https://sqs.<region>.amazonaws.com/<account>/<name>. A FIFO queue (.fifo) keeps each aggregate's order (message group = aggregate id) and drops re-sends within 5 minutes (deduplication id = event id); a standard queue keeps no order. Required with sink = sqs."),
    s("sqs.dead_letter_queue_url", Text, Run, "—",
      "sink = sqs: where events that cannot be delivered go (on_failure = dead-letter, the default when this is set); replaces dead_letter_topic."),
    s("sqs.region", Text, Run, "—",
      "sink = sqs: the AWS region; by default the one in the queue URL, else the AWS SDK's (AWS_REGION, the profile). Credentials come from the AWS chain (environment, profile, web identity, ECS, EC2)."),
    s("sqs.endpoint", Text, Run, "—",
      "sink = sqs: another SQS endpoint (a VPC endpoint, an SQS-compatible server)."),
    s("sqs.concurrency", Number, Run, "4",
      "sink = sqs: SendMessageBatch requests on their way at once (1 to 64); each aggregate's events keep to one, one batch after another."),
    Setting {
        flag_name: Some("kafka-property"),
        ..s("kafka.properties", Map, Run, "—",
            "librdkafka producer properties, KEY=VALUE: security.protocol, sasl.*, ssl.*, linger.ms, … Secret values are never printed; in the environment also one variable each, WALBOX_KAFKA_PROPERTY_SASL_PASSWORD for sasl.password. sasl.mechanism = AWS_MSK_IAM authenticates to Amazon MSK with IAM (docs/configuration.md, \"Amazon MSK with IAM\").")
    },
    s("kafka.aws_region", Text, Run, "—",
      "sasl.mechanism = AWS_MSK_IAM: the MSK cluster's AWS region; by default the region in the brokers' MSK host names, else the AWS SDK's (AWS_REGION, the profile)."),
    s("message_prefix", Text, Run, "walbox",
      "source = messages or both: the prefix of the logical decoding messages that are events; messages with other prefixes are ignored."),
    s("dead_letter_topic", Text, Run, "—",
      "Topic for events that cannot be mapped or that the broker refuses for good; without it such an event stops walbox."),
    s("on_failure", Choice(&["stop", "dead-letter", "quarantine"]), Run, "stop",
      "An event that cannot be mapped or that the broker refuses for good: stop with the slot before it; publish it to dead_letter_topic (the default when that is set) and go on; or quarantine: hold it and every later event of its aggregate in walbox.quarantine, keep every other aggregate flowing, and republish them in order on `walbox quarantine release KEY` (at least once; docs/guarantees.md, \"Failure policies\")."),
    s("quarantine.max_events", Number, Run, "100000",
      "on_failure = quarantine: most events held; one more stops walbox with the slot before it."),
    s("claim_check.bucket", Text, Run, "—",
      "Claim-check: store the value of a record larger than claim_check.threshold_bytes as an object in this S3 bucket and publish a pointer to it instead (headers walbox.claim-check.url, .sha256, .size), rather than have the broker refuse it. Credentials from the AWS chain (AWS_* variables, web identity on EKS, ECS and EC2 roles). Off by default (docs/configuration.md, \"Claim-check\")."),
    s("claim_check.endpoint", Text, Run, "—",
      "Claim-check: an S3-compatible endpoint instead of AWS (MinIO, Ceph, R2, …), http:// or https://."),
    s("claim_check.region", Text, Run, "—",
      "Claim-check: the bucket's region; default AWS_REGION or AWS_DEFAULT_REGION, else us-east-1."),
    s("claim_check.prefix", Text, Run, "walbox/",
      "Claim-check: prepended to each object's key (the value's SHA-256, hex)."),
    s("claim_check.threshold_bytes", Number, Run, "900000",
      "Claim-check: records larger than this (key, value and headers) have their value stored; keep it under the topics' max.message.bytes (Kafka's default is 1048588). With sink = sqs it is lowered under the queue's MaximumMessageSize, read at connection."),
    s("topics.create", Bool, Run, "false",
      "Create a missing event or dead-letter topic (with the topics.* settings below) instead of treating it as refused; needs the CreateTopics permission. Without it a missing topic is waited for 5 s before it counts as refused."),
    s("topics.partitions", Number, Run, "—",
      "Partitions of a topic walbox creates; default: the broker's num.partitions."),
    s("topics.replication_factor", Number, Run, "—",
      "Replication factor of a topic walbox creates; default: the broker's default.replication.factor."),
    Setting {
        flag_name: Some("topics-config"),
        ..s("topics.config", Map, Run, "—",
            "Topic configuration of a topic walbox creates, KEY=VALUE: retention.ms, min.insync.replicas, …")
    },
    s("delivery", Choice(&["at-least-once", "exactly-once"]), Run, "at-least-once",
      "What walbox promises: every event at least once (duplicates only after a crash, each with its event id), or exactly once to read_committed consumers through Kafka transactions (docs/guarantees.md). Exactly-once needs brokers with transactions."),
    s("transactions.id", Text, Run, "walbox-{slot}",
      "Exactly-once: the producer's transactional.id, and the key of its progress records. A second instance with the same id fences the first off. With shards, the default names the shard's slot (walbox-walbox_2), and an id given here gets -i appended for shard i."),
    s("transactions.progress_topic", Text, Run, "walbox.progress",
      "Exactly-once: the compacted topic of progress records, created (1 partition, cleanup.policy=compact) when missing."),
    s("transactions.max_events", Number, Run, "10000",
      "Exactly-once: most events in one Kafka transaction; a larger Postgres transaction is split across several."),
    s("transactions.max_bytes", Number, Run, "16777216", "Exactly-once: the same bound in bytes."),
    s("transactions.max_ms", Number, Run, "20",
      "Exactly-once: how long a Kafka transaction stays open after its first event: what an event waits, at most, before its commit starts."),
    s("on_slot_invalidated", Choice(&["fail", "recreate"]), Run, "fail",
      "When the slot lost WAL it needed (max_slot_wal_keep_size): stop and say what to do, or recreate it and republish from the outbox table the rows whose timestamp column is at most slot_recreate_margin_secs before the last delivered transaction's commit (saved every 10 s in walbox.positions). Duplicates possible, loss not (docs/operations.md)."),
    s("on_drift", Choice(&["stop", "heal"]), Run, "stop",
      "When the publication stops covering the outbox table's INSERTs (table removed from it, dropped and recreated): stop with the slot before the gap and say what to fix (`walbox resync --drift` then republishes what the stream did not carry), or heal: wait until it covers the table again, republish from the table the rows whose timestamp column is at most slot_recreate_margin_secs before the last delivered commit, and stream on. Duplicates possible, loss not (docs/operations.md, \"Publication drift\")."),
    s("slot_recreate_margin_secs", Number, Run, "600",
      "on_slot_invalidated = recreate and on_drift = heal: how far before the last delivered commit the republishing starts; covers transactions that ran longer than this between their timestamp and their commit."),
    s("retention", Text, Run, "—",
      "Delete outbox rows older than this (e.g. 7d, 12h) once delivered: older than the last delivered commit less slot_recreate_margin_secs too; in small paced chunks, or by dropping whole partitions of a table partitioned by range on the timestamp column (and creating them ahead). Off by default (docs/operations.md)."),
    s("audit.interval", Text, Run, "—",
      "Audit delivery continuously: every interval (e.g. 1m, at least 1s) one event the broker acknowledged in the previous one is read back from its partition (Kafka) or stream (NATS JetStream), with the records around it, on a reader of its own (RabbitMQ, SQS and webhooks refuse it, each with its reason); the walbox_audit_*_total metrics count events checked, gone from the broker and copied more than once. Reads the broker only, never the outbox table. Off by default (docs/operations.md, \"Auditing delivery\")."),
    s("backlog.max_bytes", Number, Run, "—",
      "Back-pressure: the most WAL (bytes written since the slot's confirmed position) walbox.require_capacity() lets pass; over it, the function raises SQLSTATE WB001 so the application can shed or queue writes before the primary's disk fills. walbox run reports it to walbox.relay_state every second (walbox migrate installs both); the walbox_backlog_over_budget metric says the same. No budget by default (docs/operations.md, \"Back-pressure\")."),
    s("backlog.max_age", Text, Run, "—",
      "Back-pressure: the oldest an undelivered event may be (e.g. 5m, 30s) before walbox.require_capacity() raises SQLSTATE WB001. No budget by default."),
    s("receipts", Bool, Run, "false",
      "Write a delivery receipt per event (topic, where it landed in the broker's terms: Kafka partition and offset, RabbitMQ exchange and routing key, SQS message id, NATS stream and sequence, a webhook's status; when acknowledged) to walbox.receipts (walbox migrate installs it, unlogged: no WAL), on a connection of its own, so applications can wait on walbox.await_delivery(event_id, timeout). Never holds events up: receipts that cannot be written are counted and lost. Kept as long as retention (1 hour without it). Not with delivery = exactly-once nor shards > 1 (docs/configuration.md, \"Delivery receipts\")."),
    s("skip_delivered", Bool, Run, "true with Kafka",
      "At least once on Kafka: when walbox starts, read back the end of each topic a replayed event goes to and do not send again the events already there (each record carries its origin in the walbox.origin header), so a crash or kill -9 leaves no duplicates where the broker kept its log. Read with isolation.level=read_committed: the principal needs Describe and Read on the topics (without them, the replay is sent again and a warning says so). Other brokers refuse true, each with its reason; exactly-once mode has its own (docs/guarantees.md, \"Idempotent restart\")."),
    s("skip_delivered_look_back", Number, Run, "100000",
      "skip_delivered: records read back per partition at most, from its end to the first record of this slot that was confirmed; past it, older replayed events are sent again (duplicates, never loss)."),
    s("max_in_flight_events", Number, Run, "10000",
      "Most events sent and not yet acknowledged; when reached, walbox stops reading the slot."),
    s("max_in_flight_bytes", Number, Run, "8388608",
      "The same bound in bytes (at least 1024); librdkafka's own queue is sized from it. Small events meet the event bound first; raise it for large events over a slow link (it bounds throughput at about this many bytes per round trip to the broker)."),
    s("status_interval_ms", Number, Run, "1000",
      "How often the slot position is reported; keep it below wal_sender_timeout / 2."),
    s("shutdown_timeout_secs", Number, Run, "20",
      "How long SIGINT/SIGTERM may take to finish the open transaction and in-flight deliveries; walbox exits within it plus 6 s (inside Kubernetes' 30 s grace period by default). A second signal exits at once."),
    s("otlp_endpoint", Text, Run, "—",
      "Export a span per event (its commit to its acknowledgement, a child of the event's traceparent, which the record then carries as walbox's span) to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (plain HTTP: a local agent or sidecar). Off by default."),
    s("metrics_addr", Text, Run, "—",
      "Serve Prometheus /metrics, /healthz and /readyz on IP:PORT. walbox's port is 9756 (0.0.0.0:9756; postgres_exporter has 9187, kafka_exporter 9308); off unless set (the container image sets it). Port 0 takes a free port, which the log's \"serving /metrics\" line names."),
];

/// The setting named `key`.
pub fn setting(key: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.key == key)
}
