//! MSR access that survives a #GP.
//!
//! Probing code (the PMU probe, the VMX capability report on odd CPUs) must read MSRs that may not
//! exist. The accessors are `hvprof_x86_trap`'s (`shared/x86-trap`), the same the test guests
//! use: each records its instruction's address in the `.fixup` section; when it raises #GP (a
//! reserved or unimplemented MSR, SDM Vol. 2 RDMSR and WRMSR, "64-Bit Mode Exceptions") or #UD,
//! the exception dispatcher (`interrupts::dispatch`) resumes at the next instruction and the accessor
//! returns the fault. Here a fault becomes the PMU probe's `MsrFault`, which names the MSR.

use hvprof_pmu::probe::{MsrAccess, MsrFault};

/// Reads an MSR; `Err` when the CPU faulted.
pub fn read_safe(msr: u32) -> Result<u64, MsrFault> {
    hvprof_x86_trap::read_msr(msr).map_err(|_| MsrFault { msr, write: false })
}

/// Writes an MSR; `Err` when the CPU faulted.
///
/// # Safety
/// Writing an MSR changes processor behaviour: the caller must know what the write does.
pub unsafe fn write_safe(msr: u32, value: u64) -> Result<(), MsrFault> {
    // SAFETY: the caller vouches for the effect of the write.
    unsafe { hvprof_x86_trap::write_msr(msr, value) }.map_err(|_| MsrFault { msr, write: true })
}

/// Fault-tolerant MSR access for code written against the `MsrAccess` trait (the PMU probe).
pub struct SafeMsrs;

impl MsrAccess for SafeMsrs {
    fn read(&mut self, msr: u32) -> Result<u64, MsrFault> {
        read_safe(msr)
    }
    fn write(&mut self, msr: u32, value: u64) -> Result<(), MsrFault> {
        // SAFETY: the PMU probe writes only performance-monitoring MSRs and restores them.
        unsafe { write_safe(msr, value) }
    }
}
