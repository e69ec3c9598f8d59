//! Per-CPU data. Each pCPU's IA32_GS_BASE points at its [`PerCpu`] block (the hypervisor never
//! uses GS otherwise, and every VM exit reloads it from the VMCS host-state area, SDM Vol. 3C
//! §28.5.2), so `index()` is one memory read on any path, including the NMI and timer handlers.
//!
//! pCPUs are numbered in start-up order: the boot CPU is 0, the APs 1, 2, ... as they come up.
//! `pin=` and the sample log's `pcpu` use these numbers.

use crate::arch::gdt::Selectors;
use core::sync::atomic::{AtomicU16, AtomicU64, Ordering};

/// pCPUs the hypervisor runs on at most (more in the MADT are reported and left halted).
pub const MAX_CPUS: usize = 16;

#[repr(C)]
pub struct PerCpu {
    /// This block's pCPU number; first, so `index()` reads `gs:[0]`.
    index: AtomicU64,
    /// The GDT selectors and TSS base of this pCPU (for the VMCS host state).
    selectors: spin::Once<Selectors>,
    /// The VM whose vCPU this pCPU ran last (`u16::MAX`: none yet).
    last_vm: AtomicU16,
}

impl PerCpu {
    const fn new() -> Self {
        PerCpu {
            index: AtomicU64::new(0),
            selectors: spin::Once::new(),
            last_vm: AtomicU16::new(u16::MAX),
        }
    }

    /// Records that this pCPU now runs VM `vm`; whether it ran another VM before (the caller
    /// then clears what that VM may have left in the core: `isolation::switch_vm`).
    pub fn enter_vm(&self, vm: u16) -> bool {
        let last = self.last_vm.swap(vm, Ordering::Relaxed);
        last != vm && last != u16::MAX
    }

    pub fn selectors(&self) -> Selectors {
        *self
            .selectors
            .get()
            .expect("percpu::init ran on this CPU before its VMCS use")
    }

    /// The address of this block (the value of IA32_GS_BASE on its pCPU).
    pub fn base(&self) -> u64 {
        self as *const PerCpu as u64
    }
}

static CPUS: [PerCpu; MAX_CPUS] = [const { PerCpu::new() }; MAX_CPUS];

/// Makes `index` this CPU's number: records its selectors and points IA32_GS_BASE at its block.
/// Called once per CPU, right after its GDT is loaded and before anything asks `index()`.
pub fn init(index: usize, selectors: Selectors) {
    let cpu = &CPUS[index];
    cpu.index.store(index as u64, Ordering::Relaxed);
    cpu.selectors.call_once(|| selectors);
    // IA32_GS_BASE exists on every x86-64 CPU (SDM Vol. 4, Table 2-2); the hypervisor uses GS
    // for nothing but this block, which is static and lives for the machine's life.
    x86_64::registers::model_specific::GsBase::write(x86_64::VirtAddr::new(cpu.base()));
}

/// This CPU's number.
#[inline]
pub fn index() -> usize {
    let i: u64;
    // SAFETY: GS_BASE points at this CPU's `PerCpu` (set by `init` on every CPU before it runs
    // anything that asks; restored by every VM exit), whose first field is the index.
    unsafe {
        core::arch::asm!("mov {}, gs:[0]", out(reg) i, options(nostack, readonly, preserves_flags))
    };
    i as usize
}

/// This CPU's block.
pub fn this() -> &'static PerCpu {
    &CPUS[index()]
}
