//! How far a backfill got: the rows are numbered 1, 2, 3… in publishing
//! order, and deliveries are reported in any order across partitions. The
//! cursor is the last row such that it and every earlier one were
//! delivered — the only number it is safe to resume after.

use std::collections::BTreeSet;

/// Contiguously delivered rows.
#[derive(Debug, Default)]
pub struct Cursor {
    /// Every row up to this one was delivered.
    done: u64,
    /// Delivered rows after a gap; bounded by what is in flight.
    ahead: BTreeSet<u64>,
}

impl Cursor {
    /// Resumes after row `done`.
    pub fn after(done: u64) -> Self {
        Cursor {
            done,
            ahead: BTreeSet::new(),
        }
    }

    /// Row `n` was delivered (or dead-lettered). Rows at or below the
    /// cursor are ignored.
    pub fn delivered(&mut self, n: u64) {
        if n <= self.done {
            return;
        }
        if n != self.done + 1 {
            self.ahead.insert(n);
            return;
        }
        self.done = n;
        while self.ahead.remove(&(self.done + 1)) {
            self.done += 1;
        }
    }

    /// The last row that, with all before it, was delivered.
    pub fn done(&self) -> u64 {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_only_over_contiguous_deliveries() {
        let mut c = Cursor::after(10);
        c.delivered(12);
        c.delivered(13);
        assert_eq!(c.done(), 10, "row 11 is still in flight");
        c.delivered(11);
        assert_eq!(c.done(), 13);
        c.delivered(9);
        c.delivered(13);
        assert_eq!(c.done(), 13, "old and repeated rows change nothing");
        c.delivered(15);
        assert_eq!(c.done(), 13);
        c.delivered(14);
        assert_eq!(c.done(), 15);
        assert!(c.ahead.is_empty());
    }
}
