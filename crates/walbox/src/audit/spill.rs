//! An external sort: entries are pushed in any order and come back sorted,
//! in bounded memory. Entries collect in a buffer of at most `memory`
//! bytes; a full buffer is sorted and written to a temporary file (a run);
//! [`Spill::sorted`] merges the runs (and what is left in the buffer) with
//! a heap, reading each run through a 64 KiB buffer. Memory: `memory` +
//! 64 KiB per run; disk: the entries' encoded size.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};

/// An entry that can be written to a run and read back.
pub(crate) trait Entry: Ord + Sized {
    /// Appends the encoding to `out`.
    fn encode(&self, out: &mut Vec<u8>);
    /// Decodes one entry from all of `bytes`; `None` if they are not one.
    fn decode(bytes: &[u8]) -> Option<Self>;
    /// About how many bytes it holds on the heap, the allocator's overhead
    /// included (the sort adds the entry's own size, twice: the buffer's
    /// capacity grows by doubling).
    fn weight(&self) -> usize;
}

/// Bytes read from each run at a time while merging.
const RUN_BUFFER: usize = 64 * 1024;

/// Entries being sorted.
pub(crate) struct Spill<T> {
    memory: usize,
    buffer: Vec<T>,
    held: usize,
    runs: Vec<File>,
    scratch: Vec<u8>,
}

impl<T: Entry> Spill<T> {
    /// A sort that holds at most about `memory` bytes of entries.
    pub(crate) fn new(memory: usize) -> Self {
        Spill {
            memory: memory.max(1),
            buffer: Vec::new(),
            held: 0,
            runs: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Adds an entry; writes a run when the buffer is full.
    pub(crate) fn push(&mut self, entry: T) -> io::Result<()> {
        self.held += entry.weight() + 2 * std::mem::size_of::<T>();
        self.buffer.push(entry);
        if self.held >= self.memory {
            self.write_run()?;
        }
        Ok(())
    }

    /// How many runs were written to disk.
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }

    fn write_run(&mut self) -> io::Result<()> {
        self.buffer.sort_unstable();
        let mut out = BufWriter::with_capacity(RUN_BUFFER, tempfile::tempfile()?);
        for entry in self.buffer.drain(..) {
            self.scratch.clear();
            entry.encode(&mut self.scratch);
            let len = u32::try_from(self.scratch.len())
                .map_err(|_| io::Error::other("an entry of 4 GiB or more"))?;
            out.write_all(&len.to_le_bytes())?;
            out.write_all(&self.scratch)?;
        }
        let mut file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.flush()?;
        use std::io::Seek;
        file.rewind()?;
        self.runs.push(file);
        self.held = 0;
        Ok(())
    }

    /// Every entry pushed, kept to be read in order as often as needed
    /// ([`Sealed::pass`]).
    pub(crate) fn seal(mut self) -> io::Result<Sealed<T>> {
        if !self.runs.is_empty() && !self.buffer.is_empty() {
            self.write_run()?;
        }
        self.buffer.sort_unstable();
        Ok(Sealed {
            memory: self.buffer,
            runs: self.runs,
        })
    }

    /// Every entry pushed, in order.
    pub(crate) fn sorted(mut self) -> io::Result<Sorted<T>> {
        self.buffer.sort_unstable();
        let mut sources: Vec<Source<T>> = self
            .runs
            .into_iter()
            .map(|f| Source::Run(BufReader::with_capacity(RUN_BUFFER, f), Vec::new()))
            .collect();
        sources.push(Source::Memory(std::mem::take(&mut self.buffer).into_iter()));
        Sorted::of(sources)
    }
}

/// Sorted entries that can be read again: in memory, or in runs on disk.
pub(crate) struct Sealed<T> {
    memory: Vec<T>,
    runs: Vec<File>,
}

impl<T: Entry + Clone> Sealed<T> {
    /// Every entry, in order (each pass reads the runs from their start).
    pub(crate) fn pass(&self) -> io::Result<Sorted<T>> {
        let mut sources = Vec::with_capacity(self.runs.len() + 1);
        for run in &self.runs {
            let mut file = run.try_clone()?;
            use std::io::Seek;
            file.rewind()?;
            sources.push(Source::Run(
                BufReader::with_capacity(RUN_BUFFER, file),
                Vec::new(),
            ));
        }
        sources.push(Source::Memory(self.memory.clone().into_iter()));
        Sorted::of(sources)
    }

    /// Runs on disk.
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }
}

/// The entries of two sorted streams, in order.
pub(crate) fn merge<T: Ord>(
    a: impl Iterator<Item = io::Result<T>>,
    b: impl Iterator<Item = io::Result<T>>,
) -> impl Iterator<Item = io::Result<T>> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(Ok(x)), Some(Ok(y))) => {
            if x <= y {
                a.next()
            } else {
                b.next()
            }
        }
        (Some(Err(_)), _) | (Some(_), None) => a.next(),
        (_, Some(_)) => b.next(),
        (None, None) => None,
    })
}

enum Source<T> {
    Run(BufReader<File>, Vec<u8>),
    Memory(std::vec::IntoIter<T>),
}

impl<T: Entry> Source<T> {
    fn next(&mut self) -> io::Result<Option<T>> {
        match self {
            Source::Memory(entries) => Ok(entries.next()),
            Source::Run(reader, scratch) => {
                let mut len = [0u8; 4];
                match reader.read_exact(&mut len) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
                    Err(e) => return Err(e),
                }
                scratch.resize(u32::from_le_bytes(len) as usize, 0);
                reader.read_exact(scratch)?;
                T::decode(scratch)
                    .map(Some)
                    .ok_or_else(|| io::Error::other("a sort run read back corrupt"))
            }
        }
    }
}

/// The merge of the runs: an iterator of entries in order.
pub(crate) struct Sorted<T> {
    sources: Vec<Source<T>>,
    heap: BinaryHeap<Reverse<(T, usize)>>,
}

impl<T: Entry> Sorted<T> {
    fn of(mut sources: Vec<Source<T>>) -> io::Result<Sorted<T>> {
        let mut heap = BinaryHeap::with_capacity(sources.len());
        for (i, source) in sources.iter_mut().enumerate() {
            if let Some(entry) = source.next()? {
                heap.push(Reverse((entry, i)));
            }
        }
        Ok(Sorted { sources, heap })
    }
}

impl<T: Entry> Iterator for Sorted<T> {
    type Item = io::Result<T>;

    fn next(&mut self) -> Option<io::Result<T>> {
        let Reverse((entry, i)) = self.heap.pop()?;
        match self.sources[i].next() {
            Ok(Some(next)) => self.heap.push(Reverse((next, i))),
            Ok(None) => {}
            Err(e) => return Some(Err(e)),
        }
        Some(Ok(entry))
    }
}

/// Helpers for [`Entry`] encodings: length-prefixed byte strings and
/// fixed-width integers.
pub(crate) mod codec {
    /// Appends `bytes` with its length.
    pub(crate) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    }

    /// Appends an integer.
    pub(crate) fn put_u64(out: &mut Vec<u8>, v: u64) {
        out.extend_from_slice(&v.to_le_bytes());
    }

    /// Reads what [`put_bytes`] wrote.
    pub(crate) fn bytes<'a>(input: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_le_bytes(input.get(..4)?.try_into().ok()?) as usize;
        let end = len.checked_add(4)?;
        let out = input.get(4..end)?;
        *input = &input[end..];
        Some(out)
    }

    /// Reads what [`put_bytes`] wrote, as text.
    pub(crate) fn string(input: &mut &[u8]) -> Option<String> {
        String::from_utf8(bytes(input)?.to_vec()).ok()
    }

    /// Reads what [`put_u64`] wrote.
    pub(crate) fn u64(input: &mut &[u8]) -> Option<u64> {
        let v = u64::from_le_bytes(input.get(..8)?.try_into().ok()?);
        *input = &input[8..];
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
    struct E(String, u64);

    impl Entry for E {
        fn encode(&self, out: &mut Vec<u8>) {
            codec::put_bytes(out, self.0.as_bytes());
            codec::put_u64(out, self.1);
        }
        fn decode(mut bytes: &[u8]) -> Option<Self> {
            let e = E(codec::string(&mut bytes)?, codec::u64(&mut bytes)?);
            bytes.is_empty().then_some(e)
        }
        fn weight(&self) -> usize {
            self.0.len()
        }
    }

    fn entries(n: u64) -> Vec<E> {
        // A fixed shuffle with repeats.
        (0..n)
            .map(|i| {
                let x = i.wrapping_mul(2_654_435_761) % 997;
                E(format!("k{}", x % 37), x)
            })
            .collect()
    }

    #[test]
    fn what_goes_in_comes_out_sorted_across_many_runs() {
        let input = entries(10_000);
        let mut spill = Spill::new(2_000);
        for e in input.clone() {
            spill.push(e).unwrap();
        }
        assert!(
            spill.runs() > 20,
            "the test must spill: {} runs",
            spill.runs()
        );
        let out: Vec<E> = spill.sorted().unwrap().map(Result::unwrap).collect();
        let mut expected = input;
        expected.sort();
        assert_eq!(out, expected);
    }

    #[test]
    fn a_sealed_sort_reads_the_same_entries_on_every_pass_and_merges_in_order() {
        for memory in [2_000, 1 << 20] {
            let input = entries(5_000);
            let mut spill = Spill::new(memory);
            for e in input.clone() {
                spill.push(e).unwrap();
            }
            let sealed = spill.seal().unwrap();
            let mut expected = input.clone();
            expected.sort();
            for _ in 0..2 {
                let out: Vec<E> = sealed.pass().unwrap().map(Result::unwrap).collect();
                assert_eq!(out, expected, "memory {memory}");
            }
            let mut other = Spill::new(memory);
            for e in entries(700) {
                other.push(e).unwrap();
            }
            let merged: Vec<E> = merge(sealed.pass().unwrap(), other.sorted().unwrap())
                .map(Result::unwrap)
                .collect();
            let mut all = input;
            all.extend(entries(700));
            all.sort();
            assert_eq!(merged, all);
        }
    }

    #[test]
    fn a_sort_that_fits_in_memory_writes_no_run() {
        let mut spill = Spill::new(1 << 20);
        for e in entries(100) {
            spill.push(e).unwrap();
        }
        assert_eq!(spill.runs(), 0);
        assert_eq!(spill.sorted().unwrap().count(), 100);
    }

    #[test]
    fn an_empty_sort_yields_nothing() {
        let spill: Spill<E> = Spill::new(10);
        assert_eq!(spill.sorted().unwrap().count(), 0);
    }

    #[test]
    fn truncated_encodings_decode_to_none() {
        let mut out = Vec::new();
        E("abc".into(), 7).encode(&mut out);
        for cut in 0..out.len() {
            assert_eq!(E::decode(&out[..cut]), None, "cut at {cut}");
        }
        assert_eq!(E::decode(&out), Some(E("abc".into(), 7)));
    }
}
