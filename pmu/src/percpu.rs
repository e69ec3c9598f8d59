//! One PMU sampler per pCPU. The PMU's MSRs and the local APIC's LVT entry belong to one logical
//! processor each, so each pCPU arms, services and disarms its own [`Sampler`] with its own
//! registers; nothing here is shared between pCPUs but the array that holds them.
//!
//! A pCPU's slot is touched only by that pCPU: when it arms its sampler (before any PMI can
//! arrive), in its NMI handler or right after an NMI VM exit (NMIs blocked: never twice at once),
//! and when it disarms it at the end of the run. The callers promise this by passing their own
//! pCPU number; see the safety contracts.

use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicBool, Ordering};

use crate::probe::{MsrAccess, MsrFault};
use crate::sampler::{Lapic, Sampler};

/// A pCPU's sampler and its LVT entry.
struct Slot<L> {
    state: UnsafeCell<Option<(Sampler, L)>>,
    /// Set once the sampler is in place (the NMI path reads it first).
    armed: AtomicBool,
}

/// The samplers of up to `N` pCPUs.
pub struct PerCpuSamplers<L, const N: usize> {
    slots: [Slot<L>; N],
}

// SAFETY: a slot is only ever accessed by the pCPU whose number indexes it, never concurrently
// with itself (the contracts of `arm`, `on_nmi` and `disarm`): different pCPUs touch different
// slots, so sharing the array between pCPUs is sound whenever `L` may move between threads.
unsafe impl<L: Send, const N: usize> Sync for PerCpuSamplers<L, N> {}

impl<L, const N: usize> Default for PerCpuSamplers<L, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<L, const N: usize> PerCpuSamplers<L, N> {
    /// No pCPU armed.
    pub const fn new() -> Self {
        PerCpuSamplers {
            slots: [const {
                Slot {
                    state: UnsafeCell::new(None),
                    armed: AtomicBool::new(false),
                }
            }; N],
        }
    }

    /// Whether pCPU `cpu` has an armed sampler.
    pub fn is_armed(&self, cpu: usize) -> bool {
        self.slots
            .get(cpu)
            .is_some_and(|s| s.armed.load(Ordering::Acquire))
    }
}

impl<L: Lapic, const N: usize> PerCpuSamplers<L, N> {
    /// Puts `sampler` in pCPU `cpu`'s slot and arms it with this pCPU's registers (`msrs`,
    /// `lapic`). `Err` (the slot stays empty) if `cpu` is out of range, already armed, or the
    /// registers faulted.
    ///
    /// # Safety
    /// The caller runs on pCPU `cpu`, and `msrs`/`lapic` are that pCPU's own; no PMI of this pCPU
    /// can arrive before this returns (its counter is not armed yet), and no other call for `cpu`
    /// runs at the same time.
    pub unsafe fn arm(
        &self,
        cpu: usize,
        mut sampler: Sampler,
        mut lapic: L,
        msrs: &mut impl MsrAccess,
    ) -> Result<(), ArmError> {
        let slot = self.slots.get(cpu).ok_or(ArmError::NoSuchCpu(cpu))?;
        if slot.armed.load(Ordering::Acquire) {
            return Err(ArmError::AlreadyArmed(cpu));
        }
        sampler.arm(msrs, &mut lapic).map_err(ArmError::Fault)?;
        // SAFETY: only pCPU `cpu` touches this slot (the caller's contract), and its NMI path
        // does not look at it before `armed` is set below.
        unsafe { *slot.state.get() = Some((sampler, lapic)) };
        slot.armed.store(true, Ordering::Release);
        Ok(())
    }

    /// For pCPU `cpu`'s NMI handler and NMI VM exit: was this NMI its counter's overflow (see
    /// [`Sampler::on_nmi`])? `false` when nothing is armed on `cpu` or on a fault.
    ///
    /// # Safety
    /// The caller runs on pCPU `cpu` with NMIs blocked (an NMI handler, or the exit path right
    /// after an NMI VM exit), `msrs` is that pCPU's own, and no other call for `cpu` runs at the
    /// same time.
    pub unsafe fn on_nmi(&self, cpu: usize, msrs: &mut impl MsrAccess) -> bool {
        let Some(slot) = self.slots.get(cpu) else {
            return false;
        };
        if !slot.armed.load(Ordering::Acquire) {
            return false;
        }
        // SAFETY: `armed` is set, so `arm` finished writing the slot; only pCPU `cpu` touches it
        // and never twice at once (the caller's contract).
        let state = unsafe { &mut *slot.state.get() };
        match state {
            Some((sampler, lapic)) => sampler.on_nmi(msrs, lapic).unwrap_or(false),
            None => false,
        }
    }

    /// Disarms pCPU `cpu`'s sampler and restores what it changed; the slot is empty afterwards.
    ///
    /// # Safety
    /// As for [`PerCpuSamplers::arm`]: on pCPU `cpu`, with its own registers, no concurrent call
    /// for `cpu` (its PMIs may still arrive until the counter stops: the NMI path sees `armed`
    /// cleared first).
    pub unsafe fn disarm(&self, cpu: usize, msrs: &mut impl MsrAccess) -> Result<(), MsrFault> {
        let Some(slot) = self.slots.get(cpu) else {
            return Ok(());
        };
        if !slot.armed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        // SAFETY: as in `arm`; the NMI path no longer reads the slot (`armed` is clear).
        let state = unsafe { &mut *slot.state.get() };
        match state.take() {
            Some((mut sampler, mut lapic)) => sampler.disarm(msrs, &mut lapic),
            None => Ok(()),
        }
    }
}

/// Why [`PerCpuSamplers::arm`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArmError {
    /// The pCPU number is beyond the array.
    NoSuchCpu(usize),
    /// That pCPU's sampler is armed already.
    AlreadyArmed(usize),
    /// Programming the counter faulted (it was left as it was).
    Fault(MsrFault),
}

impl core::fmt::Display for ArmError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ArmError::NoSuchCpu(c) => write!(f, "pCPU {c} is beyond the sampler table"),
            ArmError::AlreadyArmed(c) => write!(f, "pCPU {c}'s sampler is armed already"),
            ArmError::Fault(e) => write!(f, "{e}"),
        }
    }
}
