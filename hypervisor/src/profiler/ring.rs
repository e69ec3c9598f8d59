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
    pushed: AtomicU64,
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
            pushed: AtomicU64::new(0),
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
        self.pushed.fetch_add(1, Ordering::Relaxed);
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

    /// Consumer side: the record `pop` would return, left in place.
    pub fn peek(&self) -> Option<T> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        if tail == head {
            return None;
        }
        // SAFETY: as in `pop`: the slot at `tail` lies in [tail, head), published by the
        // producer and not touched by it until `tail` moves past it (which only the consumer does).
        Some(unsafe { (*self.slots[tail % N].get()).assume_init() })
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

    /// Records accepted.
    pub fn pushed(&self) -> u64 {
        self.pushed.load(Ordering::Relaxed)
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
        assert_eq!(r.peek(), Some(0));
        assert_eq!(r.pop(), Some(0));
        assert_eq!(r.peek(), Some(1));
        assert!(r.push(4));
        assert_eq!(
            (1..=4).map(|_| r.pop().unwrap()).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
        assert_eq!(r.pop(), None);
        assert_eq!(r.peek(), None);
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
