//! The hardware backend of a guest's virtual PMU (`vpmu=` on a CPU whose PMU counts: real
//! hardware, nested KVM with `pmu=on`): the guest's virtual counters run on the real counters
//! of the same index while its vCPU is loaded on a pCPU, and the model
//! ([`crate::virtual_pmu::VirtualPmu`]) keeps them while it is not.
//!
//! - **Which counters** ([`Placement`]): every real counter the host profiler does not sample
//!   with (its one counter, [`crate::sampler::Sampler::counter`]: fixed counter 2 where it
//!   exists). The counters left out (the host's) are the emulated backend's, from the vCPU's own
//!   time: reference cycles, which count at the TSC's rate, are exact that way on hardware too.
//!   General counters are placed only with full-width writes (IA32_PERF_CAPABILITIES.FW_WRITE:
//!   IA32_A_PMCx, SDM Vol. 3B §21.2.6), without which a 48-bit value cannot be loaded, and only
//!   where the real widths are the model's; a version-1 PMU (no IA32_PERF_GLOBAL_CTRL) places
//!   nothing.
//! - **When they count**: IA32_PERF_GLOBAL_CTRL switches at every VM entry and exit through the
//!   VMCS ("load IA32_PERF_GLOBAL_CTRL" entry and exit controls, SDM Vol. 3C §25.7.1, §25.8.1)
//!   ([`global_ctrl`]): the guest's placed enables and the host's while the guest runs; the
//!   host's alone while the hypervisor runs (`vpmu=cpu`), or the guest's too (`vpmu=domain`: the
//!   real counters then count the hypervisor's ring-0 work on the vCPU's exits, as OS time).
//! - **Switching vCPUs** ([`load`], [`save`]): selectors and values in, values and overflow bits
//!   out, the real selectors cleared and the host's fixed-counter field kept as it was.
//! - **Overflow**: the real PMI is the host's NMI (its LVT entry); at each one
//!   [`take_overflow`] moves the guest's counters' bits from the real IA32_PERF_GLOBAL_STATUS to
//!   the model and says whether the guest asks for a PMI, which the vCPU's local APIC then
//!   delivers, as the emulated backend's.
//!
//! Written for hardware that no machine here has (Bochs' counters never count): tested on the
//! host against a model of the MSRs that counts.

use crate::fixed_ctrl;
use crate::probe::{MsrAccess, MsrFault, PmuInfo, msr};
use crate::sampler::CounterChoice;
use crate::virtual_pmu::{FIXED, GENERAL, VirtualPmu, WIDTH};

/// Which of the guest's virtual counters run on the real counter of the same index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    general: u8,
    fixed: u8,
}

impl Placement {
    /// Every virtual counter whose real twin exists, can be loaded and is not `host`'s.
    pub fn new(info: &PmuInfo, full_width_write: bool, host: Option<CounterChoice>) -> Placement {
        if info.version < 2 {
            return Placement::default();
        }
        let mask = |n: usize| ((1u16 << n) - 1) as u8;
        let mut general = if full_width_write && u32::from(info.gp_width) == WIDTH {
            mask(GENERAL.min(usize::from(info.gp_counters)))
        } else {
            0
        };
        let mut fixed = if u32::from(info.fixed_width) == WIDTH {
            mask(FIXED.min(usize::from(info.fixed_counters)))
        } else {
            0
        };
        match host {
            Some(CounterChoice::General(i)) => general &= !(1u8.checked_shl(i.into()).unwrap_or(0)),
            Some(CounterChoice::Fixed(i)) => fixed &= !(1u8.checked_shl(i.into()).unwrap_or(0)),
            None => {}
        }
        Placement { general, fixed }
    }

    /// The placed counters' bits in IA32_PERF_GLOBAL_CTRL and _STATUS: general counter `i` bit
    /// `i`, fixed counter `j` bit `32 + j` (§21.2.2).
    pub fn global_bits(&self) -> u64 {
        u64::from(self.general) | u64::from(self.fixed) << 32
    }

    fn generals(self) -> impl Iterator<Item = usize> {
        (0..GENERAL).filter(move |i| self.general & 1 << i != 0)
    }

    fn fixeds(self) -> impl Iterator<Item = usize> {
        (0..FIXED).filter(move |j| self.fixed & 1 << j != 0)
    }

    /// The placed fixed counters' fields of IA32_FIXED_CTR_CTRL.
    fn fixed_fields(self) -> u64 {
        self.fixeds()
            .fold(0, |m, j| m | fixed_ctrl::FIELD << (4 * j))
    }
}

/// IA32_PERF_GLOBAL_CTRL at VM entry (the guest's placed enables and `host`'s bits) and at VM
/// exit (`host`'s, and the guest's too in `domain` mode).
pub fn global_ctrl(guest: &VirtualPmu, p: Placement, host: u64, domain: bool) -> (u64, u64) {
    let mine = guest.global_ctrl() & p.global_bits();
    let entry = host | mine;
    (entry, if domain { entry } else { host })
}

/// Loads the guest's placed counters into the real PMU: values, then selectors, and the fixed
/// counters' fields merged into IA32_FIXED_CTR_CTRL with the host's. Call with the guest's
/// counters disabled in the real IA32_PERF_GLOBAL_CTRL (the exit value in `cpu` mode).
pub fn load(guest: &VirtualPmu, p: Placement, msrs: &mut impl MsrAccess) -> Result<(), MsrFault> {
    for i in p.generals() {
        msrs.write(msr::IA32_A_PMC0 + i as u32, guest.general_counter(i))?;
        msrs.write(msr::IA32_PERFEVTSEL0 + i as u32, guest.evtsel(i))?;
    }
    for j in p.fixeds() {
        msrs.write(msr::IA32_FIXED_CTR0 + j as u32, guest.fixed_counter(j))?;
    }
    let fields = p.fixed_fields();
    if fields != 0 {
        let real = msrs.read(msr::IA32_FIXED_CTR_CTRL)?;
        msrs.write(
            msr::IA32_FIXED_CTR_CTRL,
            (real & !fields) | (guest.fixed_ctrl() & fields),
        )?;
    }
    Ok(())
}

/// Saves the guest's placed counters back into the model and clears their real selectors and
/// fields (the host's stay); takes their overflow bits ([`take_overflow`]). Returns whether one
/// asks the guest for a PMI.
pub fn save(
    guest: &mut VirtualPmu,
    p: Placement,
    msrs: &mut impl MsrAccess,
) -> Result<bool, MsrFault> {
    for i in p.generals() {
        msrs.write(msr::IA32_PERFEVTSEL0 + i as u32, 0)?;
        guest.set_general_counter(i, msrs.read(msr::IA32_PMC0 + i as u32)?);
    }
    let fields = p.fixed_fields();
    if fields != 0 {
        let real = msrs.read(msr::IA32_FIXED_CTR_CTRL)?;
        msrs.write(msr::IA32_FIXED_CTR_CTRL, real & !fields)?;
    }
    for j in p.fixeds() {
        guest.set_fixed_counter(j, msrs.read(msr::IA32_FIXED_CTR0 + j as u32)?);
    }
    Ok(take_overflow(guest, p, msrs)?.unwrap_or(false))
}

/// At the host's PMI (an NMI) or a save: the guest's placed counters that wrapped, moved from
/// the real IA32_PERF_GLOBAL_STATUS (cleared there through IA32_PERF_GLOBAL_OVF_CTRL, §21.2.2)
/// to the model. `None`: none wrapped; else whether one asks the guest for a PMI. The host's bit
/// is left for the host's sampler.
pub fn take_overflow(
    guest: &mut VirtualPmu,
    p: Placement,
    msrs: &mut impl MsrAccess,
) -> Result<Option<bool>, MsrFault> {
    let bits = msrs.read(msr::IA32_PERF_GLOBAL_STATUS)? & p.global_bits();
    if bits == 0 {
        return Ok(None);
    }
    msrs.write(msr::IA32_PERF_GLOBAL_OVF_CTRL, bits)?;
    Ok(Some(guest.overflowed(bits)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evtsel;
    use std::collections::HashMap;

    const MASK: u64 = (1 << 48) - 1;

    /// A version-2 PMU with 4 general and 3 fixed counters of 48 bits that counts: `run` adds
    /// `n` events (each kind) to every counter enabled for the ring, wrapping into the status.
    #[derive(Default)]
    struct Real {
        regs: HashMap<u32, u64>,
    }

    impl Real {
        fn get(&self, m: u32) -> u64 {
            self.regs.get(&m).copied().unwrap_or(0)
        }
        fn run(&mut self, user: bool, n: u64) {
            let global = self.get(msr::IA32_PERF_GLOBAL_CTRL);
            let mut wrapped = 0;
            for i in 0..4u32 {
                let sel = self.get(msr::IA32_PERFEVTSEL0 + i);
                let ring = if user { evtsel::USR } else { evtsel::OS };
                if sel & evtsel::EN != 0 && sel & ring != 0 && global & 1 << i != 0 {
                    let v = self.get(msr::IA32_PMC0 + i) + n;
                    wrapped |= u64::from(v > MASK) << i;
                    self.regs.insert(msr::IA32_PMC0 + i, v & MASK);
                }
            }
            let ctrl = self.get(msr::IA32_FIXED_CTR_CTRL);
            for j in 0..3u32 {
                let field = ctrl >> (4 * j);
                let ring = if user {
                    fixed_ctrl::USR
                } else {
                    fixed_ctrl::OS
                };
                if field & ring != 0 && global & 1 << (32 + j) != 0 {
                    let v = self.get(msr::IA32_FIXED_CTR0 + j) + n;
                    wrapped |= u64::from(v > MASK) << (32 + j);
                    self.regs.insert(msr::IA32_FIXED_CTR0 + j, v & MASK);
                }
            }
            *self.regs.entry(msr::IA32_PERF_GLOBAL_STATUS).or_default() |= wrapped;
        }
    }

    impl MsrAccess for Real {
        fn read(&mut self, m: u32) -> Result<u64, MsrFault> {
            // IA32_A_PMCx reads as IA32_PMCx.
            let m = if (msr::IA32_A_PMC0..msr::IA32_A_PMC0 + 4).contains(&m) {
                m - msr::IA32_A_PMC0 + msr::IA32_PMC0
            } else {
                m
            };
            Ok(self.get(m))
        }
        fn write(&mut self, m: u32, v: u64) -> Result<(), MsrFault> {
            match m {
                msr::IA32_PERF_GLOBAL_STATUS => {
                    return Err(MsrFault {
                        msr: m,
                        write: true,
                    });
                }
                msr::IA32_PERF_GLOBAL_OVF_CTRL => {
                    *self.regs.entry(msr::IA32_PERF_GLOBAL_STATUS).or_default() &= !v;
                }
                a if (msr::IA32_A_PMC0..msr::IA32_A_PMC0 + 4).contains(&a) => {
                    self.regs
                        .insert(a - msr::IA32_A_PMC0 + msr::IA32_PMC0, v & MASK);
                }
                _ => {
                    self.regs.insert(m, v);
                }
            }
            Ok(())
        }
    }

    fn info() -> PmuInfo {
        let (eax, _, _, edx) = VirtualPmu::new().cpuid();
        PmuInfo::from_cpuid(eax, edx)
    }

    /// The host samples with fixed counter 2 in every ring.
    fn host_armed(real: &mut Real) -> u64 {
        real.write(
            msr::IA32_FIXED_CTR_CTRL,
            (fixed_ctrl::OS | fixed_ctrl::USR | fixed_ctrl::PMI) << 8,
        )
        .unwrap();
        1 << 34
    }

    /// The guest counts user-mode instructions on fixed counter 0 and kernel-mode core cycles
    /// on general counter 1.
    fn guest() -> VirtualPmu {
        let mut g = VirtualPmu::new();
        g.write(msr::IA32_FIXED_CTR_CTRL, fixed_ctrl::USR).unwrap();
        g.write(msr::IA32_PERFEVTSEL0 + 1, evtsel::EN | evtsel::OS | 0x3c)
            .unwrap();
        g.write(msr::IA32_PERF_GLOBAL_CTRL, 1 << 32 | 1 << 1)
            .unwrap();
        g
    }

    #[test]
    fn placement_leaves_the_hosts_counter_and_what_cannot_be_loaded() {
        let i = info();
        let all = Placement::new(&i, true, None);
        assert_eq!(all.global_bits(), 0b1111 | 0b111 << 32);
        let host = Placement::new(&i, true, Some(CounterChoice::Fixed(2)));
        assert_eq!(host.global_bits(), 0b1111 | 0b011 << 32);
        let host = Placement::new(&i, true, Some(CounterChoice::General(0)));
        assert_eq!(host.global_bits(), 0b1110 | 0b111 << 32);
        let no_fw = Placement::new(&i, false, Some(CounterChoice::Fixed(2)));
        assert_eq!(
            no_fw.global_bits(),
            0b011 << 32,
            "no full-width writes: no general"
        );
        let v1 = PmuInfo { version: 1, ..i };
        assert_eq!(Placement::new(&v1, true, None).global_bits(), 0);
        let narrow = PmuInfo {
            gp_width: 40,
            fixed_width: 40,
            ..i
        };
        assert_eq!(Placement::new(&narrow, true, None).global_bits(), 0);
    }

    #[test]
    fn the_guest_counts_its_own_run_and_the_host_all_of_it() {
        for domain in [false, true] {
            let mut real = Real::default();
            let host = host_armed(&mut real);
            let p = Placement::new(&info(), true, Some(CounterChoice::Fixed(2)));
            let mut g = guest();
            real.write(msr::IA32_PERF_GLOBAL_CTRL, host).unwrap();
            load(&g, p, &mut real).unwrap();
            let (entry, exit) = global_ctrl(&g, p, host, domain);
            // The guest: 1000 events in user mode, 300 in its kernel; the hypervisor's exit: 500.
            real.write(msr::IA32_PERF_GLOBAL_CTRL, entry).unwrap();
            real.run(true, 1000);
            real.run(false, 300);
            real.write(msr::IA32_PERF_GLOBAL_CTRL, exit).unwrap();
            real.run(false, 500);
            assert!(!save(&mut g, p, &mut real).unwrap());
            assert_eq!(
                g.fixed_counter(0),
                1000,
                "user instructions, domain {domain}"
            );
            let kernel = if domain { 800 } else { 300 };
            assert_eq!(
                g.general_counter(1),
                kernel,
                "ring-0 cycles, domain {domain}"
            );
            // The host's counter counted everything, its field untouched; the guest's gone.
            assert_eq!(real.get(msr::IA32_FIXED_CTR0 + 2), 1800);
            let ctrl = real.get(msr::IA32_FIXED_CTR_CTRL);
            assert_eq!(
                ctrl,
                (fixed_ctrl::OS | fixed_ctrl::USR | fixed_ctrl::PMI) << 8
            );
            assert_eq!(real.get(msr::IA32_PERFEVTSEL0 + 1), 0);
        }
    }

    #[test]
    fn a_guest_cannot_reach_the_hosts_counter() {
        let mut real = Real::default();
        let host = host_armed(&mut real);
        let p = Placement::new(&info(), true, Some(CounterChoice::Fixed(2)));
        // The guest programs fixed counter 2 (reference cycles) off and enables it globally.
        let mut g = VirtualPmu::new();
        g.write(msr::IA32_FIXED_CTR_CTRL, 0).unwrap();
        g.write(msr::IA32_FIXED_CTR0 + 2, 12345).unwrap();
        g.write(msr::IA32_PERF_GLOBAL_CTRL, 0b111 << 32).unwrap();
        real.write(msr::IA32_FIXED_CTR0 + 2, 777).unwrap();
        load(&g, p, &mut real).unwrap();
        let (entry, _) = global_ctrl(&g, p, host, false);
        assert_eq!(entry & 1 << 34, 1 << 34, "the host's enable kept");
        assert_eq!(
            real.get(msr::IA32_FIXED_CTR0 + 2),
            777,
            "the host's value kept"
        );
        assert_eq!(
            real.get(msr::IA32_FIXED_CTR_CTRL) >> 8 & fixed_ctrl::FIELD,
            fixed_ctrl::OS | fixed_ctrl::USR | fixed_ctrl::PMI
        );
        // And the count_except of the emulated backend counts it instead.
        let slice = crate::virtual_pmu::Slice {
            user: true,
            instructions: 5,
            core_cycles: 5,
            ref_cycles: 5,
        };
        g.write(
            msr::IA32_FIXED_CTR_CTRL,
            fixed_ctrl::USR << 8 | fixed_ctrl::USR,
        )
        .unwrap();
        g.count_except(&slice, p.global_bits());
        assert_eq!(g.fixed_counter(2), 12345 + 5, "emulated");
        assert_eq!(g.fixed_counter(0), 0, "left to the real counter");
    }

    #[test]
    fn a_real_overflow_becomes_the_guests_status_and_pmi_and_leaves_the_hosts_bit() {
        let mut real = Real::default();
        let host = host_armed(&mut real);
        let p = Placement::new(&info(), true, Some(CounterChoice::Fixed(2)));
        let mut g = guest();
        g.write(msr::IA32_FIXED_CTR_CTRL, fixed_ctrl::USR | fixed_ctrl::PMI)
            .unwrap();
        g.write(msr::IA32_FIXED_CTR0, (1 << 48) - 10).unwrap();
        real.write(msr::IA32_FIXED_CTR0 + 2, (1 << 48) - 10)
            .unwrap();
        load(&g, p, &mut real).unwrap();
        let (entry, _) = global_ctrl(&g, p, host, false);
        real.write(msr::IA32_PERF_GLOBAL_CTRL, entry).unwrap();
        real.run(true, 20);
        assert_eq!(real.get(msr::IA32_PERF_GLOBAL_STATUS), 1 << 32 | 1 << 34);
        assert_eq!(
            take_overflow(&mut g, p, &mut real).unwrap(),
            Some(true),
            "a PMI for the guest"
        );
        assert_eq!(g.read(msr::IA32_PERF_GLOBAL_STATUS), Ok(1 << 32));
        assert_eq!(
            real.get(msr::IA32_PERF_GLOBAL_STATUS),
            1 << 34,
            "the host's bit stays"
        );
        assert_eq!(
            take_overflow(&mut g, p, &mut real).unwrap(),
            None,
            "taken once"
        );
        // A wrap of a counter without INT sets the status but asks for no PMI.
        g.write(msr::IA32_FIXED_CTR_CTRL, fixed_ctrl::USR).unwrap();
        real.write(msr::IA32_FIXED_CTR0, (1 << 48) - 1).unwrap();
        real.run(true, 5);
        assert_eq!(take_overflow(&mut g, p, &mut real).unwrap(), Some(false));
        assert_eq!(g.read(msr::IA32_PERF_GLOBAL_STATUS), Ok(1 << 32));
    }
}
