//! The per-pCPU sample ring: a fixed-capacity single-producer single-consumer queue. The producer
//! is the sample path (possibly in an NMI handler that interrupted the consumer on the same CPU);
//! the consumer is the exporter, outside the sample path. No lock, no allocation, bounded time:
//! `push` on a full ring fails, and the caller counts the drop.
//!
//! The producer writes only `head` (and the slot at `head`), the consumer only `tail`; a slot is
//! published by the release store of `head` and freed by the release store of `tail`.

use core::cell::UnsafeCell;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub struct Ring<T: Copy, const N: usize> {
    slots: [UnsafeCell<MaybeUninit<T>>; N],
    head: AtomicUsize,
    tail: AtomicUsize,
    dropped: AtomicU64,
    /// Slots pushed beyond the first of each record (`head` less this is the records pushed:
    /// a record of one slot, the common one, counts nothing more).
    extra_slots: AtomicU64,
}

// SAFETY: the slot protocol above gives each slot to exactly one side at a time: the producer owns
// [head, tail + N), the consumer owns [tail, head); the atomics order the hand-over.
unsafe impl<T: Copy + Send, const N: usize> Sync for Ring<T, N> {}

impl<T: Copy, const N: usize> Default for Ring<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy, const N: usize> Ring<T, N> {
    const CAPACITY_OK: () = assert!(N.is_power_of_two() && N >= 2);

    pub const fn new() -> Self {
        let () = Self::CAPACITY_OK;
        Ring {
            slots: [const { UnsafeCell::new(MaybeUninit::uninit()) }; N],
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
            extra_slots: AtomicU64::new(0),
        }
    }

    /// Producer side. `false` when the ring is full: the record is dropped and counted.
    pub fn push(&self, value: T) -> bool {
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        if head.wrapping_sub(tail) == N {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // SAFETY: the slot at `head` is outside [tail, head), so the consumer does not read it;
        // only the producer (us) writes slots.
        unsafe { (*self.slots[head % N].get()).write(value) };
        self.head.store(head.wrapping_add(1), Ordering::Release);
        true
    }

    /// Producer side: `n` values in consecutive slots, the `i`-th `value(i)`, all or none (they
    /// are written straight into the ring, in order). `false` when they do not all fit: nothing
    /// is pushed and one drop is counted (they are one record and its parts). An accepted push
    /// counts one record.
    pub fn push_with(&self, n: usize, mut value: impl FnMut(usize) -> T) -> bool {
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        if N - head.wrapping_sub(tail) < n {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        for i in 0..n {
            // SAFETY: the free slots [head, tail + N) belong to the producer (checked above that
            // all `n` fit in them); the consumer reads none of them until the release store of
            // `head` below publishes them together.
            unsafe { (*self.slots[head.wrapping_add(i) % N].get()).write(value(i)) };
        }
        self.head.store(head.wrapping_add(n), Ordering::Release);
        if n > 1 {
            self.extra_slots.fetch_add(n as u64 - 1, Ordering::Relaxed);
        }
        true
    }

    /// Consumer side.
    pub fn pop(&self) -> Option<T> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        if tail == head {
            return None;
        }
        // SAFETY: the slot at `tail` lies in [tail, head): the producer published it (release
        // store of `head`, acquired above) and will not touch it until `tail` moves past it.
        let value = unsafe { (*self.slots[tail % N].get()).assume_init() };
        self.tail.store(tail.wrapping_add(1), Ordering::Release);
        Some(value)
    }

    /// Consumer side: the records waiting now, to read in place (then `advance` past those
    /// taken). Records pushed meanwhile are not in it.
    pub fn waiting(&self) -> Waiting<'_, T, N> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        Waiting {
            ring: self,
            tail,
            len: head.wrapping_sub(tail),
        }
    }

    /// Consumer side: frees the first `n` records waiting (at most all of them).
    pub fn advance(&self, n: usize) {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let n = n.min(head.wrapping_sub(tail));
        self.tail.store(tail.wrapping_add(n), Ordering::Release);
    }

    pub fn len(&self) -> usize {
        self.head
            .load(Ordering::Acquire)
            .wrapping_sub(self.tail.load(Ordering::Acquire))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub const fn capacity(&self) -> usize {
        N
    }

    /// Counts a record the producer could not even offer (it is busy pushing another one).
    pub fn count_drop(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Records refused because the ring was full (or counted by `count_drop`).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Records accepted (producer side, or once the producer is done: `head` and the extra
    /// slots are read one after the other).
    pub fn pushed(&self) -> u64 {
        (self.head.load(Ordering::Relaxed) as u64)
            .wrapping_sub(self.extra_slots.load(Ordering::Relaxed))
    }
}

/// The records a ring's consumer found waiting (`Ring::waiting`): read without atomics, until
/// the consumer advances.
pub struct Waiting<'a, T: Copy, const N: usize> {
    ring: &'a Ring<T, N>,
    tail: usize,
    len: usize,
}

impl<T: Copy, const N: usize> Waiting<'_, T, N> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the records waiting from the `first`-th on into `out` (as many as fit, in order);
    /// returns how many. One bulk copy per contiguous run of slots, not a record at a time.
    pub fn copy_into(&self, first: usize, out: &mut [MaybeUninit<T>]) -> usize {
        let n = self.len.saturating_sub(first).min(out.len());
        let mut done = 0;
        while done < n {
            let at = self.tail.wrapping_add(first + done) % N;
            let run = (n - done).min(N - at);
            // SAFETY: slots [at, at + run) lie in the ring's array and in [tail, head) as
            // `waiting` read them (see `get`): initialized, published, and left alone by the
            // producer; `out[done..done + run]` is inside `out`. `UnsafeCell<MaybeUninit<T>>` has
            // the layout of `MaybeUninit<T>`, and the two do not overlap (`out` is the caller's).
            unsafe {
                core::ptr::copy_nonoverlapping(
                    self.ring.slots[at..].as_ptr().cast::<MaybeUninit<T>>(),
                    out[done..].as_mut_ptr(),
                    run,
                );
            }
            done += run;
        }
        n
    }

    /// The `i`-th record waiting (0 is what `pop` would return).
    pub fn get(&self, i: usize) -> Option<T> {
        if i >= self.len {
            return None;
        }
        // SAFETY: the slot lies in [tail, head) as they were when `waiting` read them (`head`
        // with acquire): published by the producer, who does not touch it until `tail` moves
        // past it, which only the consumer (the holder of this view) does.
        Some(unsafe { (*self.ring.slots[self.tail.wrapping_add(i) % N].get()).assume_init() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn fifo_and_drops() {
        let r: Ring<u32, 4> = Ring::new();
        assert!(r.is_empty());
        for i in 0..4 {
            assert!(r.push(i));
        }
        assert!(!r.push(99), "full");
        assert_eq!((r.len(), r.dropped(), r.pushed()), (4, 1, 4));
        assert_eq!(r.waiting().get(0), Some(0));
        assert_eq!(r.pop(), Some(0));
        assert_eq!(r.waiting().get(0), Some(1));
        assert!(r.push(4));
        assert_eq!(
            (1..=4).map(|_| r.pop().unwrap()).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
        assert_eq!(r.pop(), None);
        assert_eq!(r.waiting().get(0), None);
    }

    #[test]
    fn push_with_is_all_or_nothing() {
        let r: Ring<u32, 8> = Ring::new();
        let push = |v: &[u32]| r.push_with(v.len(), |i| v[i]);
        assert!(push(&[1, 2, 3]));
        assert!(push(&[4, 5, 6, 7, 8]));
        assert!(!push(&[9]), "full");
        assert_eq!(r.pop(), Some(1));
        assert!(
            !push(&[10, 11]),
            "one slot free, two wanted: nothing pushed"
        );
        assert_eq!((r.len(), r.dropped(), r.pushed()), (7, 2, 2));
        assert!(push(&[12]));
        assert!(push(&[]));
        let w = r.waiting();
        assert_eq!(
            (w.len(), w.get(0), w.get(6), w.get(7), w.get(8)),
            (8, Some(2), Some(8), Some(12), None)
        );
        // A bulk copy across the ring's wrap, from an offset, limited by the output.
        let mut out = [MaybeUninit::uninit(); 5];
        assert_eq!(w.copy_into(2, &mut out), 5);
        // SAFETY: `copy_into` wrote all five.
        let got: Vec<u32> = out.iter().map(|v| unsafe { v.assume_init() }).collect();
        assert_eq!(got, vec![4, 5, 6, 7, 8]);
        assert_eq!(w.copy_into(7, &mut out), 1);
        assert_eq!(w.copy_into(9, &mut out), 0);
        r.advance(2);
        assert_eq!(r.waiting().get(0), Some(4));
        let all: Vec<u32> = core::iter::from_fn(|| r.pop()).collect();
        assert_eq!(all, vec![4, 5, 6, 7, 8, 12]);
        r.advance(3);
        assert!(r.is_empty());
    }

    #[test]
    fn overfill_counts_every_drop_exactly() {
        let r: Ring<u64, 64> = Ring::new();
        let accepted = (0..1000u64).filter(|&i| r.push(i)).count();
        assert_eq!(accepted, 64);
        assert_eq!(r.dropped(), 936);
    }

    #[test]
    fn concurrent_producer_and_consumer_lose_nothing() {
        let r: Arc<Ring<u64, 256>> = Arc::new(Ring::new());
        let p = Arc::clone(&r);
        let producer = std::thread::spawn(move || {
            let mut sent = Vec::new();
            for i in 0..200_000u64 {
                if p.push(i) {
                    sent.push(i);
                }
            }
            sent
        });
        let mut got = Vec::new();
        while !producer.is_finished() || !r.is_empty() {
            while let Some(v) = r.pop() {
                got.push(v);
            }
        }
        let sent = producer.join().unwrap();
        assert_eq!(got, sent, "in order, none lost beyond the counted drops");
        assert_eq!(sent.len() as u64 + r.dropped(), 200_000);
    }
}
