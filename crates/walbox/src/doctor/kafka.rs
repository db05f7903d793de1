//! Kafka, as `walbox run` will find it: the brokers reachable with the
//! configured security, and for each topic walbox writes (the mapped
//! topics — for a templated name, those of a sample of the table's
//! aggregate types —, the dead-letter topic, the progress topic) that it
//! exists, its replication, `min.insync.replicas`, `cleanup.policy` and
//! `max.message.bytes` against the largest payload in the table, and the
//! principal's rights on it, from the broker's own evaluation of its ACLs
//! ([`sink_kafka::inspect`]: nothing is written).

use sink_kafka::inspect::{Cluster, Topic, TopicLook, TopicShape};

use super::{bytes, Finding};

/// What walbox writes a topic for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Events.
    Events,
    /// Dead letters.
    DeadLetter,
    /// Exactly-once's progress records.
    Progress,
}

/// A topic walbox will write.
#[derive(Clone, Debug)]
pub struct Wanted {
    /// Its name.
    pub name: String,
    /// What for.
    pub role: Role,
    /// The largest payload in the tables that map to it, in bytes.
    pub largest_payload: Option<i64>,
}

/// What the configuration says.
#[derive(Clone, Debug, Default)]
pub struct Expected {
    /// `topics.create`: walbox creates a missing topic.
    pub creates_topics: bool,
    /// Exactly-once, with this transactional id.
    pub transactional_id: Option<String>,
    /// `skip_delivered`: the topics are read back at a start.
    pub reads_back: bool,
    /// `claim_check.threshold`, when on.
    pub claim_check_threshold: Option<usize>,
    /// Templates whose topics could not be sampled (no rows yet).
    pub unsampled: Vec<String>,
}

/// Bytes a record takes beside its value: key, walbox's headers (id,
/// event type, origin, …) and the batch framing; a conservative bound.
const RECORD_OVERHEAD: i64 = 512;

/// The verdicts.
pub fn judge(cluster: &Cluster, topics: &[Topic], wanted: &[Wanted], e: &Expected) -> Vec<Finding> {
    let mut out = vec![Finding::pass(
        "kafka.connect",
        format!(
            "{} broker{} answered with the configured security",
            cluster.brokers,
            if cluster.brokers == 1 { "" } else { "s" }
        ),
    )];
    out.push(idempotence(cluster, topics, wanted));
    for template in &e.unsampled {
        out.push(Finding::info(
            "kafka.topic",
            format!("topic template {template}: no row to take an aggregate type from yet; its topics are checked once the table holds rows"),
        ));
    }
    for w in wanted {
        let Some(topic) = topics.iter().find(|t| t.name == w.name) else {
            out.push(Finding::unchecked(
                "kafka.topic",
                format!("topic {}: the cluster did not describe it", w.name),
            ));
            continue;
        };
        out.extend(topic_findings(cluster, topic, w, e));
    }
    if let Some(id) = &e.transactional_id {
        out.push(Finding::info(
            "kafka.transactional_id",
            format!("the right to write transactional id {id:?} is not checked: Kafka has no look at it that writes nothing, and taking the id would fence a running walbox; walbox run stops at start with the grant to add if it is missing"),
        ));
    }
    out
}

/// Whether `allowed` holds `op` (`ALL` holds every one).
fn allows(allowed: &[String], op: &str) -> bool {
    let norm = |s: &str| s.replace('_', "").to_ascii_lowercase();
    let op = norm(op);
    allowed.iter().any(|a| {
        let a = norm(a);
        a == op || a == "all"
    })
}

/// The principal's operations on the cluster, when visible: Kafka lists
/// them only to a principal with Describe on the cluster (an empty list
/// otherwise), and brokers before 2.3 not at all.
fn cluster_rights(cluster: &Cluster) -> Option<&[String]> {
    cluster
        .allowed
        .as_deref()
        .filter(|allowed| !allowed.is_empty())
}

fn idempotence(cluster: &Cluster, topics: &[Topic], wanted: &[Wanted]) -> Finding {
    let check = "kafka.idempotent_write";
    let visible = cluster_rights(cluster);
    if visible.is_some_and(|a| allows(a, "IdempotentWrite")) {
        return Finding::pass(check, "the principal has IdempotentWrite on the cluster");
    }
    // Kafka 2.8+ (KIP-679): Write on any topic is enough to take a
    // producer id.
    let writes = wanted.iter().any(|w| {
        topics.iter().any(|t| {
            t.name == w.name
                && matches!(&t.look, TopicLook::Found(TopicShape { allowed: Some(a), .. }) if allows(a, "Write"))
        })
    });
    match writes {
        true => Finding::pass(
            check,
            "the principal may Write a topic, which lets an idempotent producer start (Kafka 2.8+; older brokers also need IdempotentWrite on the cluster)",
        ),
        false => Finding::fail(
            check,
            format!(
                "the principal may Write none of the topics, and {}: the idempotent producer cannot start",
                match visible {
                    Some(_) => "has no IdempotentWrite on the cluster",
                    None => "its rights on the cluster are not visible (Describe on the cluster shows them)",
                }
            ),
            "kafka-acls.sh --add --allow-principal User:<walbox> --operation IdempotentWrite --cluster",
        ),
    }
}

fn topic_findings(cluster: &Cluster, topic: &Topic, w: &Wanted, e: &Expected) -> Vec<Finding> {
    let name = &w.name;
    let role = match w.role {
        Role::Events => "events",
        Role::DeadLetter => "dead-letter",
        Role::Progress => "progress",
    };
    let shape = match &topic.look {
        TopicLook::Found(shape) => shape,
        TopicLook::Absent => {
            let create = format!(
                "kafka-topics.sh --create --topic {name} --partitions <N> --replication-factor 3 --config min.insync.replicas=2{}",
                if w.role == Role::Progress { " --config cleanup.policy=compact" } else { "" }
            );
            let may_create = cluster_rights(cluster).is_some_and(|a| allows(a, "Create"));
            return vec![match (e.creates_topics, cluster.auto_create_topics) {
                (true, _) if may_create => Finding::pass(
                    "kafka.topic",
                    format!("{role} topic {name} does not exist; walbox creates it (topics.create)"),
                ),
                (true, _) => Finding::warn(
                    "kafka.topic",
                    format!("{role} topic {name} does not exist; walbox creates it (topics.create), which needs Create on the topic or the cluster: the principal has no Create on the cluster that doctor can see, and a right on the topic itself cannot be seen before it exists"),
                    format!("kafka-acls.sh --add --allow-principal User:<walbox> --operation Create --topic {name}, or create it: {create}"),
                ),
                (false, Some(true)) => Finding::warn(
                    "kafka.topic",
                    format!("{role} topic {name} does not exist; the brokers create it at the first write, with their defaults (num.partitions, default.replication.factor)"),
                    create,
                ),
                (false, _) => Finding::fail(
                    "kafka.topic",
                    format!("{role} topic {name} does not exist, and neither walbox (topics.create) nor the brokers (auto.create.topics.enable) create it: its events would stall"),
                    create,
                ),
            }];
        }
        TopicLook::Unauthorized => {
            return vec![Finding::fail(
                "kafka.topic",
                format!("{role} topic {name}: the principal may not describe it (TOPIC_AUTHORIZATION_FAILED)"),
                format!("kafka-acls.sh --add --allow-principal User:<walbox> --operation Describe --operation Write{} --topic {name}", if w.role == Role::Events { "" } else { " --operation Read" }),
            )];
        }
        TopicLook::Failed(why) => {
            return vec![Finding::unchecked(
                "kafka.topic",
                format!("{role} topic {name}: {why}"),
            )];
        }
    };
    let mut out = vec![Finding::pass(
        "kafka.topic",
        format!(
            "{role} topic {name}: {} partition{}, replication factor {}",
            shape.partitions,
            if shape.partitions == 1 { "" } else { "s" },
            shape.replication_factor
        ),
    )];
    if let Err(why) = &shape.settings {
        out.push(Finding::unchecked(
            "kafka.topic.settings",
            format!("topic {name}: its settings (min.insync.replicas, cleanup.policy, max.message.bytes) are not readable ({why}); grant DescribeConfigs on it to the principal doctor runs as"),
        ));
    }
    out.push(replication(name, shape));
    if let Some(f) = cleanup(name, shape, w.role) {
        out.push(f);
    }
    if let Some(f) = size(name, shape, w, e) {
        out.push(f);
    }
    out.push(rights(name, shape, w.role, e));
    out
}

fn setting<'a>(shape: &'a TopicShape, key: &str) -> Option<&'a str> {
    shape.settings.as_ref().ok()?.get(key).map(String::as_str)
}

fn replication(name: &str, shape: &TopicShape) -> Finding {
    let check = "kafka.topic.replication";
    let rf = shape.replication_factor;
    let min_isr = setting(shape, "min.insync.replicas").and_then(|v| v.parse::<usize>().ok());
    let fix_isr = format!(
        "kafka-configs.sh --alter --entity-type topics --entity-name {name} --add-config min.insync.replicas=2"
    );
    match min_isr {
        Some(m) if m > rf => Finding::fail(
            check,
            format!("topic {name}: min.insync.replicas = {m} is above its replication factor {rf}: every write with acks=all is refused (NOT_ENOUGH_REPLICAS) and walbox stalls"),
            fix_isr,
        ),
        _ if rf < 3 => Finding::warn(
            check,
            format!("topic {name}: replication factor {rf}: losing {} loses acknowledged events", if rf <= 1 { "its broker" } else { "two brokers" }),
            "reassign it to 3 replicas (kafka-reassign-partitions.sh), or recreate it with --replication-factor 3 --config min.insync.replicas=2",
        ),
        Some(m) if m < 2 => Finding::warn(
            check,
            format!("topic {name}: min.insync.replicas = {m}: a write acknowledged by one replica is lost with that broker"),
            fix_isr,
        ),
        // Unreadable: said once, as kafka.topic.settings.
        None => Finding::pass(check, format!("topic {name}: replication factor {rf}")),
        Some(m) => Finding::pass(
            check,
            format!("topic {name}: replication factor {rf}, min.insync.replicas = {m}"),
        ),
    }
}

fn cleanup(name: &str, shape: &TopicShape, role: Role) -> Option<Finding> {
    let check = "kafka.topic.cleanup_policy";
    let policy = setting(shape, "cleanup.policy")?;
    let compacts = policy.split(',').any(|p| p.trim() == "compact");
    let deletes = policy.split(',').any(|p| p.trim() == "delete");
    Some(match (role, compacts, deletes) {
        (Role::Progress, true, false) => Finding::pass(check, format!("progress topic {name}: compact")),
        (Role::Progress, _, _) => Finding::warn(
            check,
            format!("progress topic {name}: cleanup.policy = {policy}: retention can delete the last progress record, and exactly-once then stops at start"),
            format!("kafka-configs.sh --alter --entity-type topics --entity-name {name} --add-config cleanup.policy=compact"),
        ),
        (_, true, _) => Finding::warn(
            check,
            format!("topic {name}: cleanup.policy = {policy}: compaction keeps only an aggregate's latest event, and consumers that start later miss the rest"),
            format!("kafka-configs.sh --alter --entity-type topics --entity-name {name} --add-config cleanup.policy=delete"),
        ),
        _ => Finding::pass(check, format!("topic {name}: {policy}")),
    })
}

fn size(name: &str, shape: &TopicShape, w: &Wanted, e: &Expected) -> Option<Finding> {
    let check = "kafka.topic.max_message_bytes";
    if w.role == Role::Progress {
        return None;
    }
    let max: i64 = setting(shape, "max.message.bytes")?.parse().ok()?;
    if let Some(threshold) = e.claim_check_threshold {
        return Some(match threshold as i64 > max {
            true => Finding::fail(
                check,
                format!("topic {name}: max.message.bytes = {max} is below claim_check.threshold ({threshold}): records between the two are refused"),
                format!("set claim_check.threshold under {max}"),
            ),
            false => Finding::pass(
                check,
                format!("topic {name}: max.message.bytes = {max}; values over claim_check.threshold ({threshold}) are stored aside"),
            ),
        });
    }
    let largest = w.largest_payload?;
    Some(match largest + RECORD_OVERHEAD > max {
        true => Finding::fail(
            check,
            format!("topic {name}: the largest payload in the outbox ({}) does not fit max.message.bytes = {max}: the broker refuses that event for good, and walbox halts or dead-letters it", bytes(largest)),
            format!("kafka-configs.sh --alter --entity-type topics --entity-name {name} --add-config max.message.bytes={} (and the producer's message.max.bytes), or turn on claim_check", ((largest + RECORD_OVERHEAD) as u64).next_power_of_two()),
        ),
        false => Finding::pass(
            check,
            format!("topic {name}: the largest payload in the outbox ({}) fits max.message.bytes = {max}", bytes(largest)),
        ),
    })
}

fn rights(name: &str, shape: &TopicShape, role: Role, e: &Expected) -> Finding {
    let check = "kafka.topic.rights";
    let Some(allowed) = &shape.allowed else {
        return Finding::info(
            check,
            format!(
                "topic {name}: the brokers did not say which operations the principal may perform"
            ),
        );
    };
    let mut needed = vec!["Describe", "Write"];
    if role == Role::Progress {
        needed.push("Read");
    }
    let missing: Vec<&str> = needed
        .iter()
        .copied()
        .filter(|op| !allows(allowed, op))
        .collect();
    let grant = |ops: &[&str]| {
        format!(
            "kafka-acls.sh --add --allow-principal User:<walbox> {} --topic {name}",
            ops.iter()
                .map(|o| format!("--operation {o}"))
                .collect::<Vec<_>>()
                .join(" ")
        )
    };
    if !missing.is_empty() {
        return Finding::fail(
            check,
            format!(
                "topic {name}: the principal lacks {} on it",
                missing.join(" and ")
            ),
            grant(&missing),
        );
    }
    let reads = role != Role::Progress && e.reads_back;
    if reads && !allows(allowed, "Read") {
        return Finding::warn(
            check,
            format!("topic {name}: the principal may not Read it: after a crash walbox cannot look at what it already delivered (skip_delivered), and re-sends it as duplicates"),
            grant(&["Read"]),
        );
    }
    Finding::pass(
        check,
        format!(
            "topic {name}: the principal may {}",
            if reads || role == Role::Progress {
                "Describe, Write and Read it"
            } else {
                "Describe and Write it"
            }
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::Verdict;
    use super::*;

    fn shape(rf: usize, settings: &[(&str, &str)], allowed: &[&str]) -> TopicLook {
        TopicLook::Found(TopicShape {
            partitions: 3,
            replication_factor: rf,
            allowed: Some(allowed.iter().map(|s| s.to_string()).collect()),
            settings: Ok(settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()),
        })
    }

    fn cluster(ops: &[&str]) -> Cluster {
        Cluster {
            brokers: 3,
            allowed: Some(ops.iter().map(|s| s.to_string()).collect()),
            auto_create_topics: Some(false),
        }
    }

    fn events(name: &str, largest: Option<i64>) -> Wanted {
        Wanted {
            name: name.into(),
            role: Role::Events,
            largest_payload: largest,
        }
    }

    fn verdicts(findings: &[Finding], check: &str) -> Vec<Verdict> {
        findings
            .iter()
            .filter(|f| f.check == check)
            .map(|f| f.verdict)
            .collect()
    }

    const GOOD: [(&str, &str); 3] = [
        ("min.insync.replicas", "2"),
        ("cleanup.policy", "delete"),
        ("max.message.bytes", "1048588"),
    ];

    #[test]
    fn a_well_made_topic_passes() {
        let topics = [Topic {
            name: "orders".into(),
            look: shape(3, &GOOD, &["DESCRIBE", "WRITE", "READ"]),
        }];
        let findings = judge(
            &cluster(&["DESCRIBE"]),
            &topics,
            &[events("orders", Some(2000))],
            &Expected {
                reads_back: true,
                ..Expected::default()
            },
        );
        let bad: Vec<_> = findings
            .iter()
            .filter(|f| f.verdict != Verdict::Pass)
            .collect();
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[test]
    fn each_topic_problem_has_its_verdict() {
        let topics = [
            Topic {
                name: "thin".into(),
                look: shape(
                    1,
                    &[
                        ("min.insync.replicas", "1"),
                        ("cleanup.policy", "compact"),
                        ("max.message.bytes", "1000"),
                    ],
                    &["DESCRIBE"],
                ),
            },
            Topic {
                name: "gone".into(),
                look: TopicLook::Absent,
            },
            Topic {
                name: "strict".into(),
                look: shape(2, &[("min.insync.replicas", "3")], &["ALL"]),
            },
        ];
        let wanted = [
            events("thin", Some(5000)),
            events("gone", None),
            events("strict", None),
        ];
        let findings = judge(&cluster(&[]), &topics, &wanted, &Expected::default());
        assert_eq!(
            verdicts(&findings, "kafka.topic.replication"),
            [Verdict::Warn, Verdict::Fail]
        );
        assert_eq!(
            verdicts(&findings, "kafka.topic.cleanup_policy"),
            [Verdict::Warn]
        );
        assert_eq!(
            verdicts(&findings, "kafka.topic.max_message_bytes"),
            [Verdict::Fail]
        );
        assert_eq!(
            verdicts(&findings, "kafka.topic.rights"),
            [Verdict::Fail, Verdict::Pass]
        );
        assert_eq!(
            verdicts(&findings, "kafka.topic"),
            [Verdict::Pass, Verdict::Fail, Verdict::Pass]
        );
        // Write on "strict" (ALL) lets the idempotent producer start.
        assert_eq!(
            verdicts(&findings, "kafka.idempotent_write"),
            [Verdict::Pass]
        );
        let rights = findings
            .iter()
            .find(|f| f.check == "kafka.topic.rights")
            .unwrap();
        assert!(
            rights
                .fix
                .as_deref()
                .unwrap()
                .contains("--operation Write --topic thin"),
            "{rights:?}"
        );
    }

    #[test]
    fn a_missing_topic_is_fine_only_when_someone_creates_it() {
        let topics = [Topic {
            name: "t".into(),
            look: TopicLook::Absent,
        }];
        let wanted = [events("t", None)];
        let mut c = cluster(&["IDEMPOTENT_WRITE"]);
        let v = |c: &Cluster, e: &Expected| verdicts(&judge(c, &topics, &wanted, e), "kafka.topic");
        let creates = Expected {
            creates_topics: true,
            ..Expected::default()
        };
        assert_eq!(v(&c, &Expected::default()), [Verdict::Fail]);
        // walbox creates it, without Create on the cluster: maybe not.
        assert_eq!(v(&c, &creates), [Verdict::Warn]);
        let with_create = cluster(&["IDEMPOTENT_WRITE", "CREATE"]);
        assert_eq!(v(&with_create, &creates), [Verdict::Pass]);
        c.auto_create_topics = Some(true);
        assert_eq!(v(&c, &Expected::default()), [Verdict::Warn]);
    }

    #[test]
    fn reading_back_needs_read_and_the_progress_topic_compaction() {
        let topics = [
            Topic {
                name: "e".into(),
                look: shape(3, &GOOD, &["WRITE", "DESCRIBE"]),
            },
            Topic {
                name: "p".into(),
                look: shape(3, &GOOD, &["WRITE", "DESCRIBE", "READ"]),
            },
        ];
        let wanted = [
            events("e", None),
            Wanted {
                name: "p".into(),
                role: Role::Progress,
                largest_payload: None,
            },
        ];
        let e = Expected {
            reads_back: true,
            transactional_id: Some("walbox-1".into()),
            ..Expected::default()
        };
        let findings = judge(&cluster(&["IDEMPOTENT_WRITE"]), &topics, &wanted, &e);
        assert_eq!(
            verdicts(&findings, "kafka.topic.rights"),
            [Verdict::Warn, Verdict::Pass]
        );
        assert_eq!(
            verdicts(&findings, "kafka.topic.cleanup_policy"),
            [Verdict::Pass, Verdict::Warn]
        );
        assert_eq!(
            verdicts(&findings, "kafka.transactional_id"),
            [Verdict::Info]
        );
    }
}
