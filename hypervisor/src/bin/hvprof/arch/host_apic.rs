//! The local APIC of this CPU (Intel SDM Vol. 3A chapter 12, "Advanced Programmable Interrupt
//! Controller"): xAPIC through its MMIO page, or x2APIC through MSRs when the firmware left it in
//! x2APIC mode (§12.12). Used for the profiler's deadline clock while the hypervisor runs (TSC-
//! deadline mode, §12.5.4.1, or one-shot mode calibrated against the TSC) and for the PMI's LVT
//! entry.

use crate::arch::msr;

const IA32_APIC_BASE: u32 = 0x1b;
const IA32_TSC_DEADLINE: u32 = 0x6e0;
const X2APIC_MSR_BASE: u32 = 0x800;

// Register offsets in the xAPIC page (§12.4.1, Table 12-1).
const REG_ID: u32 = 0x20;
const REG_TPR: u32 = 0x80;
const REG_EOI: u32 = 0xb0;
const REG_SVR: u32 = 0xf0;
const REG_LVT_TIMER: u32 = 0x320;
pub const REG_LVT_PMI: u32 = 0x340;
const REG_TIMER_INITIAL: u32 = 0x380;
const REG_TIMER_CURRENT: u32 = 0x390;
const REG_TIMER_DIVIDE: u32 = 0x3e0;
const REG_ICR_LOW: u32 = 0x300;
const REG_ICR_HIGH: u32 = 0x310;

/// The vector of the profiler's timer interrupt, and the spurious vector.
pub const TIMER_VECTOR: u8 = 0xef;
/// The vector of a kick from another pCPU: a vCPU this pCPU runs or keeps halted has an IPI
/// from its VM's other vCPUs (its handler only acknowledges it; the interrupt itself ends the
/// guest's run or the pCPU's HLT).
pub const KICK_VECTOR: u8 = 0xee;
pub const SPURIOUS_VECTOR: u8 = 0xff;

#[derive(Clone, Copy, Debug)]
pub enum TimerMode {
    /// IA32_TSC_DEADLINE (CPUID.1:ECX.TSC_Deadline[bit 24]).
    TscDeadline,
    /// One-shot count-down; `ticks_per_tsc_q32` = LAPIC timer ticks per TSC tick, 32.32 fixed point.
    OneShot { ticks_per_tsc_q32: u64 },
}

#[derive(Clone, Copy, Debug)]
pub struct Lapic {
    base: u64,
    x2apic: bool,
    pub timer: TimerMode,
}

impl Lapic {
    /// Enables this CPU's local APIC (software enable in the SVR, spurious vector 0xff, TPR 0) and
    /// chooses the timer mode.
    pub fn init() -> Option<Lapic> {
        let apic_base = msr::read_safe(IA32_APIC_BASE).ok()?;
        // Bit 11: APIC globally enabled; bit 10: x2APIC mode (§12.4.4, §12.12.1).
        if apic_base & (1 << 11) == 0 {
            return None;
        }
        let mut lapic = Lapic {
            base: apic_base & 0x000f_ffff_ffff_f000,
            x2apic: apic_base & (1 << 10) != 0,
            timer: TimerMode::TscDeadline,
        };
        lapic.write(REG_TPR, 0);
        lapic.write(REG_SVR, 0x100 | SPURIOUS_VECTOR as u32);
        let deadline = raw_cpuid::CpuId::new()
            .get_feature_info()
            .is_some_and(|f| f.has_tsc_deadline());
        if deadline {
            // Vector, unmasked, timer mode 10b = TSC-deadline (§12.5.4.1).
            lapic.write(REG_LVT_TIMER, TIMER_VECTOR as u32 | (0b10 << 17));
        } else {
            lapic.timer = TimerMode::OneShot {
                ticks_per_tsc_q32: lapic.calibrate_one_shot(),
            };
        }
        Some(lapic)
    }

    /// Measures LAPIC timer ticks per TSC tick over 100,000 TSC ticks (divide by 1).
    fn calibrate_one_shot(&self) -> u64 {
        self.write(REG_TIMER_DIVIDE, 0b1011);
        // Masked one-shot while measuring.
        self.write(REG_LVT_TIMER, (1 << 16) | TIMER_VECTOR as u32);
        self.write(REG_TIMER_INITIAL, u32::MAX);
        let start = crate::tsc::rdtsc();
        while crate::tsc::rdtsc() - start < 100_000 {
            core::hint::spin_loop();
        }
        let elapsed_tsc = crate::tsc::rdtsc() - start;
        let counted = u32::MAX - self.read(REG_TIMER_CURRENT);
        self.write(REG_TIMER_INITIAL, 0);
        self.write(REG_LVT_TIMER, TIMER_VECTOR as u32);
        ((counted as u64) << 32) / elapsed_tsc.max(1)
    }

    pub fn id(&self) -> u32 {
        let id = self.read(REG_ID);
        if self.x2apic { id } else { id >> 24 }
    }

    /// Fires the timer interrupt at TSC `deadline` (now if it has passed).
    pub fn arm(&self, deadline: u64) {
        match self.timer {
            TimerMode::TscDeadline => {
                // SAFETY: IA32_TSC_DEADLINE only arms this CPU's timer, set to our vector.
                let _ = unsafe { msr::write_safe(IA32_TSC_DEADLINE, deadline.max(1)) };
            }
            TimerMode::OneShot { ticks_per_tsc_q32 } => {
                let now = crate::tsc::rdtsc();
                let ticks = ((deadline.saturating_sub(now) as u128 * ticks_per_tsc_q32 as u128)
                    >> 32)
                    .clamp(1, u32::MAX as u128) as u32;
                self.write(REG_TIMER_INITIAL, ticks);
            }
        }
    }

    /// Stops the timer.
    pub fn disarm(&self) {
        match self.timer {
            TimerMode::TscDeadline => {
                // SAFETY: writing 0 disarms the TSC-deadline timer (§12.5.4.1).
                let _ = unsafe { msr::write_safe(IA32_TSC_DEADLINE, 0) };
            }
            TimerMode::OneShot { .. } => self.write(REG_TIMER_INITIAL, 0),
        }
    }

    /// Sends an IPI: `low` is the ICR's low word (vector, delivery mode, level), `apic_id` the
    /// destination (physical destination mode, §12.6.1). Waits until the xAPIC accepted it.
    pub fn send_ipi(&self, apic_id: u32, low: u32) {
        if self.x2apic {
            // The x2APIC ICR is one 64-bit MSR (0x830), destination in bits 63:32 (§12.12.9).
            let value = ((apic_id as u64) << 32) | low as u64;
            // SAFETY: the ICR sends the IPI the caller asked for; nothing else.
            let _ = unsafe { msr::write_safe(X2APIC_MSR_BASE + (REG_ICR_LOW >> 4), value) };
        } else {
            self.write(REG_ICR_HIGH, apic_id << 24);
            self.write(REG_ICR_LOW, low);
            // Delivery status (bit 12) clears when the IPI was sent.
            while self.read(REG_ICR_LOW) & (1 << 12) != 0 {
                core::hint::spin_loop();
            }
        }
    }

    pub fn eoi(&self) {
        self.write(REG_EOI, 0);
    }

    pub fn read(&self, reg: u32) -> u32 {
        if self.x2apic {
            msr::read_safe(X2APIC_MSR_BASE + (reg >> 4)).unwrap_or(0) as u32
        } else {
            // SAFETY: the xAPIC page is identity-mapped below 4 GiB (uncached through the MTRRs on
            // real hardware); `reg` is a register offset from Table 12-1.
            unsafe { core::ptr::read_volatile((self.base + reg as u64) as *const u32) }
        }
    }

    pub fn write(&self, reg: u32, value: u32) {
        if self.x2apic {
            // SAFETY: x2APIC register MSRs (§12.12.1.2) of this CPU's own APIC.
            let _ = unsafe { msr::write_safe(X2APIC_MSR_BASE + (reg >> 4), value as u64) };
        } else {
            // SAFETY: as for `read`.
            unsafe { core::ptr::write_volatile((self.base + reg as u64) as *mut u32, value) }
        }
    }
}
