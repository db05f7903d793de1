//! What the cluster says about the topics walbox will write, without
//! writing anything: each topic's partitions, replicas and settings
//! (`min.insync.replicas`, `cleanup.policy`, `max.message.bytes`), and
//! the operations the principal is allowed on each and on the cluster
//! (Kafka's "authorized operations", KIP-430: the broker evaluates the
//! principal's ACLs and answers with the operations they allow).
//!
//! librdkafka describes topics and the cluster with their authorized
//! operations (`rd_kafka_DescribeTopics`, `rd_kafka_DescribeCluster`), which
//! rust-rdkafka does not wrap: they are called here through its bindings.
//! Settings come from `DescribeConfigs`, which needs the `DescribeConfigs`
//! right: refused, they are reported as unknown, not as a failure.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::bindings as rd;
use rdkafka::config::FromClientConfigAndContext;

use crate::config::{redact_values, SinkConfig};
use crate::reader::Quiet;

/// The topic settings read.
pub const TOPIC_SETTINGS: [&str; 3] =
    ["min.insync.replicas", "cleanup.policy", "max.message.bytes"];

/// The cluster, as the principal sees it.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    /// The brokers that answered the description.
    pub brokers: usize,
    /// The operations the principal may perform on the cluster
    /// (`IdempotentWrite`, …); `None` when the broker did not say.
    pub allowed: Option<Vec<String>>,
    /// `auto.create.topics.enable` of a broker; `None`: not readable.
    pub auto_create_topics: Option<bool>,
}

/// One topic.
#[derive(Clone, Debug)]
pub struct Topic {
    /// Its name.
    pub name: String,
    /// What the cluster said.
    pub look: TopicLook,
}

/// What the cluster said about a topic.
#[derive(Clone, Debug)]
pub enum TopicLook {
    /// It does not exist.
    Absent,
    /// The principal may not even describe it.
    Unauthorized,
    /// Another error, as the broker named it.
    Failed(String),
    /// It exists.
    Found(TopicShape),
}

/// An existing topic.
#[derive(Clone, Debug)]
pub struct TopicShape {
    /// Partitions.
    pub partitions: usize,
    /// The smallest replica count of its partitions.
    pub replication_factor: usize,
    /// The operations the principal may perform on it (`Read`, `Write`,
    /// `Describe`, …); `None` when the broker did not say.
    pub allowed: Option<Vec<String>>,
    /// [`TOPIC_SETTINGS`] as set or defaulted; `Err`: why unknown.
    pub settings: Result<BTreeMap<String, String>, String>,
}

/// Describes the cluster and `topics` with the producer's connection
/// settings (TLS, SASL, …). An error: the cluster could not be described
/// at all (unreachable, the credentials refused), scrubbed of secrets.
pub async fn inspect(
    config: &SinkConfig,
    topics: &[String],
    timeout: Duration,
) -> Result<(Cluster, Vec<Topic>), String> {
    let secrets: Arc<[String]> = config.secret_values().into();
    let tokens = config.tokens().map_err(|e| e.to_string())?;
    let context = Quiet {
        secrets: Arc::clone(&secrets),
        tokens: tokens.clone(),
    };
    let admin: AdminClient<Quiet> =
        AdminClient::from_config_and_context(&config.connection_config(), context)
            .map_err(|e| redact_values(&format!("create an admin client: {e}"), &secrets))?;
    if let Some(tokens) = &tokens {
        tokens.prime(admin.inner());
    }
    let admin = Arc::new(admin);
    let described = {
        let admin = Arc::clone(&admin);
        let topics = topics.to_vec();
        tokio::task::spawn_blocking(move || describe(&admin, &topics, timeout))
            .await
            .map_err(|e| format!("describe the cluster: {e}"))?
    };
    let (mut cluster, mut found, broker_id) = described.map_err(|e| redact_values(&e, &secrets))?;
    let options = AdminOptions::new().request_timeout(Some(timeout));
    if let Some(id) = broker_id {
        let broker = [ResourceSpecifier::Broker(id)];
        if let Ok(results) = admin.describe_configs(&broker, &options).await {
            cluster.auto_create_topics = results
                .into_iter()
                .flatten()
                .flat_map(|r| r.entries)
                .find(|e| e.name == "auto.create.topics.enable")
                .and_then(|e| e.value)
                .map(|v| v == "true");
        }
    }
    for topic in &mut found {
        let TopicLook::Found(shape) = &mut topic.look else {
            continue;
        };
        let resource = [ResourceSpecifier::Topic(&topic.name)];
        shape.settings = match admin.describe_configs(&resource, &options).await {
            Err(e) => Err(redact_values(&e.to_string(), &secrets)),
            Ok(results) => match results.into_iter().next() {
                // A principal without DescribeConfigs gets an empty answer.
                Some(Ok(resource)) if resource.entries.is_empty() => {
                    Err("no setting returned: DescribeConfigs refused?".into())
                }
                Some(Ok(resource)) => Ok(resource
                    .entries
                    .into_iter()
                    .filter(|e| TOPIC_SETTINGS.contains(&e.name.as_str()))
                    .filter_map(|e| Some((e.name, e.value?)))
                    .collect()),
                Some(Err(code)) => Err(format!("{code:?}")),
                None => Err("no answer".into()),
            },
        };
    }
    Ok((cluster, found))
}

/// A handle librdkafka made, destroyed on drop.
struct Owned<T> {
    ptr: *mut T,
    destroy: unsafe extern "C" fn(*mut T),
}

impl<T> Drop for Owned<T> {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` was returned by the librdkafka constructor that
            // `destroy` pairs with, and is destroyed once, here.
            unsafe { (self.destroy)(self.ptr) }
        }
    }
}

/// The cluster, the topics and a broker's id, described. Blocking.
#[allow(unsafe_code)]
fn describe(
    admin: &AdminClient<Quiet>,
    topics: &[String],
    timeout: Duration,
) -> Result<(Cluster, Vec<Topic>, Option<i32>), String> {
    let rk = admin.inner().native_ptr();
    let timeout_ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
    // SAFETY (for every call below): `rk` is the live client `admin`
    // borrows for this whole function; each handle is used only while its
    // `Owned` lives, and results are read before their event is destroyed.
    let queue = Owned {
        ptr: unsafe { rd::rd_kafka_queue_new(rk) },
        destroy: rd::rd_kafka_queue_destroy,
    };
    let options = |op| -> Result<Owned<rd::rd_kafka_AdminOptions_t>, String> {
        let options = Owned {
            ptr: unsafe { rd::rd_kafka_AdminOptions_new(rk, op) },
            destroy: rd::rd_kafka_AdminOptions_destroy,
        };
        let mut error = [0 as c_char; 256];
        let code = unsafe {
            rd::rd_kafka_AdminOptions_set_request_timeout(
                options.ptr,
                timeout_ms,
                error.as_mut_ptr(),
                error.len(),
            )
        };
        if code != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(unsafe { text(error.as_ptr()) });
        }
        let refused =
            unsafe { rd::rd_kafka_AdminOptions_set_include_authorized_operations(options.ptr, 1) };
        if !refused.is_null() {
            let why = unsafe { text(rd::rd_kafka_error_string(refused)) };
            unsafe { rd::rd_kafka_error_destroy(refused) };
            return Err(why);
        }
        Ok(options)
    };
    // Waits for the one answer on `queue`.
    let answer = |what: &str| -> Result<Owned<rd::rd_kafka_event_t>, String> {
        let event = Owned {
            ptr: unsafe { rd::rd_kafka_queue_poll(queue.ptr, timeout_ms.saturating_add(1000)) },
            destroy: rd::rd_kafka_event_destroy,
        };
        if event.ptr.is_null() {
            return Err(format!(
                "{what}: no answer within {} s (the brokers unreachable?)",
                timeout.as_secs()
            ));
        }
        let code = unsafe { rd::rd_kafka_event_error(event.ptr) };
        if code != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            let why = unsafe { text(rd::rd_kafka_event_error_string(event.ptr)) };
            return Err(format!("{what}: {why}"));
        }
        Ok(event)
    };

    let cluster_options = options(rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBECLUSTER)?;
    unsafe { rd::rd_kafka_DescribeCluster(rk, cluster_options.ptr, queue.ptr) };
    let event = answer("describe the cluster")?;
    let result = unsafe { rd::rd_kafka_event_DescribeCluster_result(event.ptr) };
    if result.is_null() {
        return Err("describe the cluster: an unexpected answer".into());
    }
    let mut count = 0usize;
    let nodes = unsafe { rd::rd_kafka_DescribeCluster_result_nodes(result, &mut count) };
    let nodes = unsafe { items(nodes, count) };
    let broker_id = nodes.first().map(|n| unsafe { rd::rd_kafka_Node_id(*n) });
    let mut ops = 0usize;
    let allowed =
        unsafe { rd::rd_kafka_DescribeCluster_result_authorized_operations(result, &mut ops) };
    let cluster = Cluster {
        brokers: nodes.len(),
        allowed: unsafe { operations(allowed, ops) },
        auto_create_topics: None,
    };
    drop(event);

    if topics.is_empty() {
        return Ok((cluster, Vec::new(), broker_id));
    }
    let names: Vec<CString> = topics
        .iter()
        .map(|t| CString::new(t.as_str()).map_err(|_| format!("topic {t:?} holds a NUL byte")))
        .collect::<Result<_, _>>()?;
    let mut pointers: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let collection = Owned {
        ptr: unsafe {
            rd::rd_kafka_TopicCollection_of_topic_names(pointers.as_mut_ptr(), pointers.len())
        },
        destroy: rd::rd_kafka_TopicCollection_destroy,
    };
    let topic_options = options(rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS)?;
    unsafe { rd::rd_kafka_DescribeTopics(rk, collection.ptr, topic_options.ptr, queue.ptr) };
    let event = answer("describe the topics")?;
    let result = unsafe { rd::rd_kafka_event_DescribeTopics_result(event.ptr) };
    if result.is_null() {
        return Err("describe the topics: an unexpected answer".into());
    }
    let mut count = 0usize;
    let descriptions = unsafe { rd::rd_kafka_DescribeTopics_result_topics(result, &mut count) };
    let descriptions = unsafe { items(descriptions, count) };
    let mut found = Vec::with_capacity(descriptions.len());
    for &d in descriptions {
        let name = unsafe { text(rd::rd_kafka_TopicDescription_name(d)) };
        let error = unsafe { rd::rd_kafka_TopicDescription_error(d) };
        let code = match error.is_null() {
            true => rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR,
            false => unsafe { rd::rd_kafka_error_code(error) },
        };
        use rd::rd_kafka_resp_err_t as E;
        let look = match code {
            E::RD_KAFKA_RESP_ERR_NO_ERROR => {
                let mut count = 0usize;
                let partitions = unsafe { rd::rd_kafka_TopicDescription_partitions(d, &mut count) };
                let partitions = unsafe { items(partitions, count) };
                let replication_factor = partitions
                    .iter()
                    .map(|p| {
                        let mut replicas = 0usize;
                        unsafe { rd::rd_kafka_TopicPartitionInfo_replicas(*p, &mut replicas) };
                        replicas
                    })
                    .min()
                    .unwrap_or(0);
                let mut ops = 0usize;
                let allowed =
                    unsafe { rd::rd_kafka_TopicDescription_authorized_operations(d, &mut ops) };
                TopicLook::Found(TopicShape {
                    partitions: partitions.len(),
                    replication_factor,
                    allowed: unsafe { operations(allowed, ops) },
                    settings: Err("not read".into()),
                })
            }
            E::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART => TopicLook::Absent,
            E::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED => TopicLook::Unauthorized,
            other => TopicLook::Failed(format!(
                "{:?}: {}",
                rdkafka::error::RDKafkaErrorCode::from(other),
                unsafe { text(rd::rd_kafka_error_string(error)) }
            )),
        };
        found.push(Topic { name, look });
    }
    drop(event);
    Ok((cluster, found, broker_id))
}

/// The `count` items librdkafka returned at `items`; empty for null.
///
/// # Safety
/// `items` is null or points at `count` items that outlive `'a` (the
/// result they belong to is not destroyed meanwhile).
#[allow(unsafe_code)]
unsafe fn items<'a, T>(items: *const T, count: usize) -> &'a [T] {
    match items.is_null() {
        true => &[],
        false => unsafe { std::slice::from_raw_parts(items, count) },
    }
}

/// A C string librdkafka owns, copied; empty for null.
///
/// # Safety
/// `p` is null or a NUL-terminated string live for the call.
#[allow(unsafe_code)]
unsafe fn text(p: *const c_char) -> String {
    match p.is_null() {
        true => String::new(),
        false => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
    }
}

/// The names of `count` operations at `ops`; `None` for null (not said).
///
/// # Safety
/// `ops` is null or points at `count` operations live for the call.
#[allow(unsafe_code)]
unsafe fn operations(ops: *const rd::rd_kafka_AclOperation_t, count: usize) -> Option<Vec<String>> {
    if ops.is_null() {
        return None;
    }
    let ops = unsafe { items(ops, count) };
    Some(
        ops.iter()
            .map(|op| unsafe { text(rd::rd_kafka_AclOperation_name(*op)) })
            .collect(),
    )
}
