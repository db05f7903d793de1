//! Producer settings that the delivery contract depends on.

/// Settings walbox applies to every producer unless the operator overrides
/// them, with the reason for each.
///
/// * `acks=all`, `enable.idempotence=true`: an acknowledged message is on every
///   in-sync replica, and retries neither duplicate nor reorder within a partition.
/// * `message.timeout.ms=0` (infinite): a long broker outage stalls the relay
///   instead of failing deliveries. The outbox in Postgres is the buffer; a
///   stalled relay is correct, a dropped event is not.
/// * `compression.type=lz4`, `linger.ms=5`: small batches, cheap compression.
pub fn contract_defaults() -> Vec<(&'static str, &'static str)> {
    vec![
        ("acks", "all"),
        ("enable.idempotence", "true"),
        ("message.timeout.ms", "0"),
        ("compression.type", "lz4"),
        ("linger.ms", "5"),
    ]
}

/// Settings an operator may not override, because the guarantees rely on them.
pub const CONTRACT_PINNED: &[&str] = &["acks", "enable.idempotence"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_protect_the_contract() {
        let d = contract_defaults();
        let get = |k: &str| d.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
        assert_eq!(get("acks"), Some("all"));
        assert_eq!(get("enable.idempotence"), Some("true"));
        assert_eq!(get("message.timeout.ms"), Some("0"));
        for pinned in CONTRACT_PINNED {
            assert!(
                get(pinned).is_some(),
                "{pinned} is pinned but has no default"
            );
        }
    }
}
