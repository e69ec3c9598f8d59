//! Kicks between pCPUs: one pCPU asks another to look at its vCPUs' IPIs or its run queue, with
//! an interrupt that is sent only while none is on its way there. A guest that makes kicks in a
//! loop then costs the target at most one interrupt per look, whatever the rate (docs/SECURITY.md,
//! "Kick storms"). The interrupt itself is the sampler's (`bin/hvprof/profiler/sampler.rs`:
//! `kick_cpu`, `on_kick`); this is its state, per target pCPU.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub struct KickState {
    /// Another pCPU kicked this one since it last looked (`take`).
    kicked: AtomicBool,
    /// A kick's interrupt is on its way here and not taken yet (`taken` clears it).
    in_flight: AtomicBool,
    /// Kick interrupts this pCPU took.
    taken: AtomicU64,
}

impl KickState {
    #[inline]
    pub const fn new() -> Self {
        KickState {
            kicked: AtomicBool::new(false),
            in_flight: AtomicBool::new(false),
            taken: AtomicU64::new(0),
        }
    }

    #[inline]
    /// A kick for this pCPU: remembered for its next look. Returns whether the sender must send
    /// the interrupt (none is on its way).
    pub fn request(&self) -> bool {
        self.kicked.store(true, Ordering::Release);
        // AcqRel: pairs with `taken`'s swap, so that what the sender published before the kick
        // (a vCPU's kick bit) is seen by the target after it took the interrupt in flight.
        !self.in_flight.swap(true, Ordering::AcqRel)
    }

    #[inline]
    /// The kick's interrupt arrived here: the next kick sends one again.
    pub fn taken(&self) {
        self.in_flight.swap(false, Ordering::AcqRel);
        self.taken.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    /// Whether a kick came since the last call (and forgets it).
    pub fn take(&self) -> bool {
        self.kicked.swap(false, Ordering::Acquire)
    }

    #[inline]
    /// Kick interrupts taken.
    pub fn interrupts_taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }
}

impl Default for KickState {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storm_of_kicks_sends_one_interrupt_until_it_is_taken() {
        let k = KickState::new();
        assert!(k.request(), "the first kick sends");
        for _ in 0..1000 {
            assert!(!k.request(), "no second interrupt while one is on its way");
        }
        k.taken();
        assert_eq!(k.interrupts_taken(), 1);
        assert!(k.take(), "the kicks are seen at the next look");
        assert!(!k.take(), "and forgotten after it");
        assert!(k.request(), "after the interrupt, a new kick sends again");
    }

    #[test]
    fn a_kick_while_the_interrupt_is_in_flight_is_still_seen() {
        let k = KickState::new();
        assert!(k.request());
        // The target looks (and forgets) before its interrupt arrives...
        assert!(k.take());
        // ...then another kick comes: no interrupt is sent, but the look after sees it.
        assert!(!k.request());
        k.taken();
        assert!(k.take());
    }
}
