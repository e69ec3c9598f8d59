//! MSR access that survives a #GP.
//!
//! Probing code (the PMU probe, the VMX capability report on odd CPUs) must read MSRs that may not
//! exist. Each access here records its instruction's address in the `.fixup` section; when it
//! faults, the exception dispatcher (`idt::dispatch`) resumes at the next instruction with the
//! vector + 1 in R8, which was zero before the access. RDMSR/WRMSR raise #GP for a reserved or
//! unimplemented MSR (SDM Vol. 2B, RDMSR/WRMSR "Protected Mode Exceptions").

use hvprof_pmu::probe::{MsrAccess, MsrFault};

/// Reads an MSR; `Err` when the CPU faulted.
pub fn read_safe(msr: u32) -> Result<u64, MsrFault> {
    let (lo, hi): (u32, u32);
    let fault: u64;
    // SAFETY: RDMSR only reads; a #GP is caught by the fixup entry and reported in R8. The
    // caller runs in ring 0 (the hypervisor never runs elsewhere).
    unsafe {
        core::arch::asm!(
            "xor r8d, r8d",
            "2: rdmsr",
            "3:",
            ".pushsection .fixup, \"a\"",
            ".balign 8",
            ".quad 2b, 3b",
            ".popsection",
            in("ecx") msr,
            out("eax") lo,
            out("edx") hi,
            out("r8") fault,
            options(nostack),
        );
    }
    if fault != 0 {
        Err(MsrFault { msr, write: false })
    } else {
        Ok(((hi as u64) << 32) | lo as u64)
    }
}

/// Writes an MSR; `Err` when the CPU faulted.
///
/// # Safety
/// Writing an MSR changes processor behaviour: the caller must know what the write does.
pub unsafe fn write_safe(msr: u32, value: u64) -> Result<(), MsrFault> {
    let fault: u64;
    // SAFETY: the caller vouches for the effect of the write; a #GP is caught by the fixup entry.
    unsafe {
        core::arch::asm!(
            "xor r8d, r8d",
            "2: wrmsr",
            "3:",
            ".pushsection .fixup, \"a\"",
            ".balign 8",
            ".quad 2b, 3b",
            ".popsection",
            in("ecx") msr,
            in("eax") value as u32,
            in("edx") (value >> 32) as u32,
            out("r8") fault,
            options(nostack),
        );
    }
    if fault != 0 {
        Err(MsrFault { msr, write: true })
    } else {
        Ok(())
    }
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
