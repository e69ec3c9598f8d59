//! What a pCPU clears when it goes from one VM to another, so that nothing one VM left in the
//! core's predictors and buffers reaches the next: an indirect branch prediction barrier
//! (IA32_PRED_CMD.IBPB), an L1 data cache flush (IA32_FLUSH_CMD.L1D_FLUSH) and, where the CPU
//! clears its microarchitectural buffers with VERW (MD_CLEAR), a VERW. Each where the CPU
//! enumerates it (CPUID.(EAX=7,ECX=0):EDX bits 26, 28 and 10; Intel's "Speculative Execution
//! Side Channel Mitigations" and "Deep Dive: Intel Analysis of L1 Terminal Fault"). The state the
//! architecture defines (registers, FPU/AVX, debug registers, XCR0, CR8, MSRs) is switched per
//! vCPU elsewhere (`vcpu`).

use core::sync::atomic::{AtomicU8, Ordering};

const IA32_PRED_CMD: u32 = 0x49;
const IA32_FLUSH_CMD: u32 = 0x10b;

const IBPB: u8 = 1 << 0;
const L1D_FLUSH: u8 = 1 << 1;
const VERW: u8 = 1 << 2;

static AVAILABLE: AtomicU8 = AtomicU8::new(0);

/// Reads what the CPU offers; returns a line for the boot log.
pub fn init() -> alloc::string::String {
    let edx = raw_cpuid::native_cpuid::cpuid_count(7, 0).edx;
    let mut have = 0;
    if edx & (1 << 26) != 0 {
        have |= IBPB;
    }
    if edx & (1 << 28) != 0 {
        have |= L1D_FLUSH;
    }
    if edx & (1 << 10) != 0 {
        have |= VERW;
    }
    AVAILABLE.store(have, Ordering::Relaxed);
    let yes = |b| {
        if have & b != 0 {
            "yes"
        } else {
            "no (not offered)"
        }
    };
    alloc::format!(
        "isolation: between VMs on a pCPU: IBPB {}, L1D flush {}, VERW buffer clearing {}",
        yes(IBPB),
        yes(L1D_FLUSH),
        yes(VERW)
    )
}

/// Called when this pCPU is about to run a vCPU of another VM than the one it ran last.
pub fn switch_vm(data_selector: u16) {
    let have = AVAILABLE.load(Ordering::Relaxed);
    if have & IBPB != 0 {
        // SAFETY: writing IBPB (bit 0) to IA32_PRED_CMD, which the CPU enumerates, only discards
        // indirect branch predictions.
        let _ = unsafe { crate::arch::msr::write_safe(IA32_PRED_CMD, 1) };
    }
    if have & L1D_FLUSH != 0 {
        // SAFETY: writing L1D_FLUSH (bit 0) to IA32_FLUSH_CMD, which the CPU enumerates, only
        // writes back and invalidates the L1 data cache.
        let _ = unsafe { crate::arch::msr::write_safe(IA32_FLUSH_CMD, 1) };
    }
    if have & VERW != 0 {
        let selector = data_selector;
        // SAFETY: VERW with a memory operand holding a valid data-segment selector of the
        // hypervisor's GDT: it sets ZF and, with MD_CLEAR, clears the CPU's buffers; it touches
        // no memory but the 2-byte operand it reads.
        unsafe {
            core::arch::asm!("verw word ptr [{}]", in(reg) &selector, options(nostack, readonly))
        };
    }
}
