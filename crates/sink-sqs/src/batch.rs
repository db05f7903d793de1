//! Which waiting messages go into the next `SendMessageBatch`, the rule
//! that keeps each message group's order on a FIFO queue:
//!
//! - a batch holds at most one message of each group, so that a partial
//!   failure (one entry failed, the others sent) never lets a later
//!   message of a group arrive before an earlier one;
//! - a group's message is never taken past an earlier message of the same
//!   group left waiting (because its group is in the batch already, or it
//!   did not fit the batch's bytes);
//! - the lane sends one batch at a time and puts what must be sent again
//!   back in front, in order (the sender's part).
//!
//! On a standard queue (no order to keep) only the limits apply.

use std::collections::{HashSet, VecDeque};

/// SendMessageBatch's most entries.
pub(crate) const MAX_ENTRIES: usize = 10;
/// How far into a lane's queue a batch is looked for.
const SCAN: usize = 200;

/// What the batch rule needs to know of a waiting message.
pub(crate) trait Waiting {
    /// Its message group (FIFO queues).
    fn group(&self) -> &str;
    /// Its size as SQS counts it.
    fn size(&self) -> usize;
}

/// Takes the next batch from `queue`: at most `max_entries` messages of at
/// most `max_bytes` in all (a first message is taken whatever its size:
/// it was checked against the queue's limit).
pub(crate) fn take<P: Waiting>(
    queue: &mut VecDeque<P>,
    fifo: bool,
    max_entries: usize,
    max_bytes: usize,
) -> Vec<P> {
    let mut chosen: Vec<usize> = Vec::new();
    let mut groups: HashSet<&str> = HashSet::new();
    let mut blocked: HashSet<&str> = HashSet::new();
    let mut bytes = 0usize;
    for (i, p) in queue.iter().enumerate().take(SCAN) {
        if chosen.len() == max_entries.max(1) {
            break;
        }
        let group = p.group();
        if fifo && (groups.contains(group) || blocked.contains(group)) {
            continue;
        }
        if !chosen.is_empty() && bytes + p.size() > max_bytes {
            if fifo {
                blocked.insert(group);
            }
            continue;
        }
        bytes += p.size();
        groups.insert(group);
        chosen.push(i);
    }
    if chosen.len() == queue.len() {
        return queue.drain(..).collect();
    }
    let mut taken = Vec::with_capacity(chosen.len());
    // Remove from the back so that the indexes stay right.
    for &i in chosen.iter().rev() {
        taken.push(queue.remove(i).expect("an index seen above"));
    }
    taken.reverse();
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct W(&'static str, usize, u32);

    impl Waiting for W {
        fn group(&self) -> &str {
            self.0
        }
        fn size(&self) -> usize {
            self.1
        }
    }

    fn ids(v: &[W]) -> Vec<u32> {
        v.iter().map(|w| w.2).collect()
    }

    #[test]
    fn a_fifo_batch_holds_one_message_per_group_in_order() {
        let mut q: VecDeque<W> = [
            W("a", 1, 1),
            W("a", 1, 2),
            W("b", 1, 3),
            W("c", 1, 4),
            W("b", 1, 5),
        ]
        .into();
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [1, 3, 4]);
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [2, 5]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_group_left_for_bytes_is_not_overtaken_by_its_own_later_message() {
        let mut q: VecDeque<W> =
            [W("a", 60, 1), W("b", 60, 2), W("c", 10, 3), W("b", 10, 4)].into();
        // b's first does not fit beside a's: b waits, c goes, b's second
        // does not pass b's first.
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [1, 3]);
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [2]);
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [4]);
    }

    #[test]
    fn a_standard_queue_batches_by_the_limits_only() {
        let mut q: VecDeque<W> = (0..25).map(|i| W("a", 10, i)).collect();
        assert_eq!(take(&mut q, false, 10, 1000).len(), 10);
        assert_eq!(ids(&take(&mut q, false, 10, 35)), [10, 11, 12]);
        assert_eq!(q.len(), 12);
    }

    #[test]
    fn a_first_message_goes_whatever_its_size_and_limits_hold() {
        let mut q: VecDeque<W> = [W("a", 500, 1), W("b", 1, 2)].into();
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [1]);
        let mut q: VecDeque<W> = (0..30)
            .map(|i| W(["x", "y", "z"][i as usize % 3], 1, i))
            .collect();
        assert_eq!(ids(&take(&mut q, true, 2, 100)), [0, 1]);
        assert_eq!(ids(&take(&mut q, true, 10, 100)), [2, 3, 4]);
    }
}
