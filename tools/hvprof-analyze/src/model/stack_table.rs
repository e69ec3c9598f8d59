//! The table every sample is looked up in: (address, context) → (stack, samples).
//!
//! A capture holds hundreds of thousands of distinct stacks, so this table is larger than the
//! caches and each lookup is a miss to memory. An open-addressing table whose slot holds the
//! key, the stack and its count lets the caller hash a whole block's samples first and
//! [`StackTable::prefetch`] their slots, then look them up: the misses overlap instead of
//! following one another, and each sample touches one slot (no separate control bytes, no
//! second array for the count).

/// One slot, three words: the address; the context in the low half and the number plus one in
/// the high half (0: an empty slot); the count. All zeros is an empty slot, so that a new
/// table is memory the allocator hands out zeroed, never written first.
type Slot = [u64; 3];

/// A full slot's second word.
#[inline(always)]
fn tag(ctx: u32, id: u32) -> u64 {
    u64::from(ctx) | u64::from(id + 1) << 32
}

/// Whether a slot is empty.
#[inline(always)]
fn empty(s: &Slot) -> bool {
    s[1] >> 32 == 0
}

/// A full slot's number.
#[inline(always)]
fn id(s: &Slot) -> u32 {
    ((s[1] >> 32) - 1) as u32
}

/// Asks the CPU to bring `value` into the cache, for a random access a little later (a hint:
/// no effect on what the program computes).
#[inline(always)]
pub fn prefetch<T: ?Sized>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let at = core::ptr::from_ref(value).cast::<i8>();
        // SAFETY: SSE is part of x86_64's baseline, so every x86_64 CPU has PREFETCHT0; a
        // prefetch reads nothing the program sees and never faults. `value` may end in the
        // next cache line: its last byte's line is asked for too.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(at);
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(size_of_val(value).saturating_sub(1)));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// (address, context) → (stack number, samples), linear probing, at most 5/8 full.
#[derive(Debug)]
pub struct StackTable {
    slots: Vec<Slot>,
    len: usize,
    mask: usize,
}

impl Default for StackTable {
    fn default() -> Self {
        Self::with_slots(1024)
    }
}

/// The hash of (address, context): a folded multiply (the high and low halves of the 128-bit
/// product xored), so that every bit of both reaches the low bits the table indexes with.
#[inline(always)]
pub fn hash(addr: u64, ctx: u32) -> u64 {
    let m = u128::from(addr ^ 0x243f_6a88_85a3_08d3)
        * u128::from(u64::from(ctx) ^ 0x1319_8a2e_0370_7344);
    (m as u64) ^ ((m >> 64) as u64)
}

impl StackTable {
    fn with_slots(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        StackTable {
            slots: vec![[0; 3]; n],
            len: 0,
            mask: n - 1,
        }
    }

    /// Asks the CPU to bring the slot of `hash` into the cache (a hint: no effect on what
    /// the table holds).
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        prefetch(&self.slots[hash as usize & self.mask]);
    }

    /// Adds `n` samples to (`addr`, `ctx`), whose hash is `hash`; when it is new it gets the
    /// number `next` (less than `u32::MAX`). Returns its number and whether it was new.
    #[inline]
    pub fn add(&mut self, hash: u64, addr: u64, ctx: u32, n: u64, next: u32) -> (u32, bool) {
        let mut i = hash as usize & self.mask;
        loop {
            let s = &mut self.slots[i];
            if empty(s) {
                break;
            }
            if s[0] == addr && s[1] as u32 == ctx {
                s[2] += n;
                return (id(s), false);
            }
            i = (i + 1) & self.mask;
        }
        if (self.len + 1) * 8 > self.slots.len() * 5 {
            self.grow();
            i = self.free_slot(hash);
        }
        self.slots[i] = [addr, tag(ctx, next), n];
        self.len += 1;
        (next, true)
    }

    /// Every entry: (address, context, number, samples), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32, u32, u64)> + '_ {
        self.slots
            .iter()
            .filter(|s| !empty(s))
            .map(|s| (s[0], s[1] as u32, id(s), s[2]))
    }

    /// The first empty slot from `hash`'s.
    fn free_slot(&self, hash: u64) -> usize {
        let mut i = hash as usize & self.mask;
        while !empty(&self.slots[i]) {
            i = (i + 1) & self.mask;
        }
        i
    }

    /// Twice the slots, every entry moved to its place in them.
    #[cold]
    fn grow(&mut self) {
        let mut bigger = Self::with_slots(self.slots.len() * 2);
        for s in self.slots.iter().filter(|s| !empty(s)) {
            let i = bigger.free_slot(hash(s[0], s[1] as u32));
            bigger.slots[i] = *s;
        }
        bigger.len = self.len;
        *self = bigger;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn counts_and_numbers_like_a_map() {
        let mut t = StackTable::default();
        let mut want: HashMap<(u64, u32), (u32, u64)> = HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..200_000u64 {
            // A few contexts, clustered addresses (as a capture's are), some repeated.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let addr = 0xffff_ffff_8100_0000 + (x % 50_000) * 4;
            let ctx = (x >> 40) as u32 % 7;
            let n = step % 3 + 1;
            let next = want.len() as u32;
            let (id, new) = t.add(hash(addr, ctx), addr, ctx, n, next);
            let e = want.entry((addr, ctx)).or_insert((next, 0));
            assert_eq!(new, e.1 == 0);
            assert_eq!(id, e.0);
            e.1 += n;
        }
        assert_eq!((t.len, t.iter().count()), (want.len(), want.len()));
        let got: HashMap<(u64, u32), (u32, u64)> =
            t.iter().map(|(a, c, id, n)| ((a, c), (id, n))).collect();
        assert_eq!(got, want);
    }
}
