//! A model of the CPU's side of APIC virtualization with virtual-interrupt delivery in xAPIC
//! mode, for the tests of [`Lapic::hand_over`] and [`Lapic::take_back`]: the vCPU's
//! virtual-APIC page and the guest interrupt status (RVI, SVI) as the CPU changes them while the
//! guest runs, without a VM exit. Per Intel SDM Vol. 3C:
//! - §29.1.1, "Virtualized APIC Registers": VTPR at 080H, VPPR at 0A0H, VEOI at 0B0H, VISR at
//!   100H-170H, VIRR at 200H-270H (bit `x` at bit `x & 1FH` of offset `base | (x & E0H) >> 1`),
//!   VICR_LO and VICR_HI at 300H and 310H;
//! - §29.1.2, "TPR Virtualization" (with virtual-interrupt delivery: PPR virtualization, then
//!   evaluation of pending virtual interrupts); §29.1.3, "PPR Virtualization"; §29.1.4, "EOI
//!   Virtualization"; §29.1.5, "Self-IPI Virtualization";
//! - §29.2.1, "Evaluation of Pending Virtual Interrupts", and §29.2.2, "Virtual-Interrupt
//!   Delivery";
//! - §29.4.3.2, "APIC-Write Emulation": which writes to 080H, 0B0H, 300H and 310H the CPU
//!   completes itself, and which exit (APIC-write VM exit);
//! - §27.3.2.5 (VM entry with virtual-interrupt delivery performs PPR virtualization and
//!   evaluates pending virtual interrupts).
//!
//! It writes the page at VM entry as `vm/virtual_apic.rs` does (`enter`: the page registers
//! after a generation change, then only the words `hand_over` says differ) and takes the state
//! back as it does (`exit`); and it checks, at each entry, that what the model believes the page
//! and the VMCS hold is what they hold, and that the page then shows the model's state and
//! registers.

use super::{Lapic, PAGE_REGISTERS, VirtualState, reg};

/// VICR_LO bits that must be 0 for self-IPI virtualization (§29.4.3.2): reserved bits 31:20,
/// 17:16 and 13, and bit 12 (delivery status).
const ICR_MUST_BE_ZERO: u32 = 0xfff0_0000 | 0x3_0000 | 1 << 13 | 1 << 12;

/// The CPU's copy of a vCPU's virtual-APIC state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuVapic {
    /// The virtual-APIC page as 32-bit words (word `i` at offset `4 * i`).
    page: Vec<u32>,
    /// The guest interrupt status: RVI in bits 7:0, SVI in bits 15:8 (§24.4.2).
    pub status: u16,
    /// EOI-exit bitmap 0-3.
    pub eoi_exit: [u64; 4],
    /// The model's `generation` whose registers the page shows (`u64::MAX`: none yet).
    generation: u64,
}

impl Default for CpuVapic {
    fn default() -> Self {
        CpuVapic::new()
    }
}

impl CpuVapic {
    /// As `virtual_apic::enable` leaves it: the page zeroed, RVI and SVI 0, no EOI exits.
    pub fn new() -> CpuVapic {
        CpuVapic {
            page: vec![0; 1024],
            status: 0,
            eoi_exit: [0; 4],
            generation: u64::MAX,
        }
    }

    /// The word at page offset `offset`.
    pub fn word(&self, offset: u32) -> u32 {
        self.page[(offset / 4) as usize]
    }

    fn set_word(&mut self, offset: u32, value: u32) {
        self.page[(offset / 4) as usize] = value;
    }

    fn bit(&self, base: u32, v: u8) -> bool {
        self.word(base + 0x10 * (u32::from(v) / 32)) & (1 << (v % 32)) != 0
    }

    fn set_bit(&mut self, base: u32, v: u8, on: bool) {
        let at = base + 0x10 * (u32::from(v) / 32);
        let w = self.word(at);
        self.set_word(
            at,
            if on {
                w | 1 << (v % 32)
            } else {
                w & !(1 << (v % 32))
            },
        );
    }

    /// The highest vector set in VIRR (`reg::IRR`) or VISR (`reg::ISR`).
    fn highest(&self, base: u32) -> Option<u8> {
        (0..=255u8).rev().find(|&v| self.bit(base, v))
    }

    /// The vectors set in VIRR or VISR, lowest first.
    pub fn vectors(&self, base: u32) -> Vec<u8> {
        (0..=255u8).filter(|&v| self.bit(base, v)).collect()
    }

    pub fn rvi(&self) -> u8 {
        self.status as u8
    }

    pub fn svi(&self) -> u8 {
        (self.status >> 8) as u8
    }

    fn set_rvi(&mut self, v: u8) {
        self.status = (self.status & 0xff00) | u16::from(v);
    }

    fn set_svi(&mut self, v: u8) {
        self.status = (self.status & 0x00ff) | u16::from(v) << 8;
    }

    /// What the page and the VMCS hold, as `hand_over` describes them.
    pub fn state(&self) -> VirtualState {
        let mut s = VirtualState {
            tpr: self.word(reg::TPR),
            irr: [0; 8],
            isr: [0; 8],
            status: self.status,
            eoi_exit: self.eoi_exit,
        };
        for i in 0..8 {
            s.irr[i] = self.word(reg::IRR + 0x10 * i as u32);
            s.isr[i] = self.word(reg::ISR + 0x10 * i as u32);
        }
        s
    }

    /// A VM entry: the model's state written as `virtual_apic::hand_over` writes it, then
    /// PPR virtualization and the evaluation of pending virtual interrupts (§27.3.2.5, "Updating
    /// Non-Register State"). Returns what `hand_over` returned. Panics if the model's idea of
    /// what the page holds is not what it holds.
    pub fn enter(&mut self, lapic: &mut Lapic) -> Option<(VirtualState, Option<VirtualState>)> {
        if lapic.generation() != self.generation {
            let mut written = Vec::new();
            lapic.page_registers(|o, v| written.push((o, v)));
            for (o, v) in written {
                self.set_word(o, v);
            }
            self.generation = lapic.generation();
        }
        let given = lapic.hand_over();
        if let Some((new, before)) = given {
            if let Some(before) = before {
                assert_eq!(
                    before,
                    self.state(),
                    "the model's idea of the page and the VMCS is not what they hold"
                );
            }
            let all = before.is_none();
            let old = before.unwrap_or_default();
            if all || old.tpr != new.tpr {
                self.set_word(reg::TPR, new.tpr);
            }
            for i in 0..8 {
                let at = 0x10 * i as u32;
                if all || old.irr[i] != new.irr[i] {
                    self.set_word(reg::IRR + at, new.irr[i]);
                }
                if all || old.isr[i] != new.isr[i] {
                    self.set_word(reg::ISR + at, new.isr[i]);
                }
            }
            if all || old.status != new.status {
                self.status = new.status;
            }
            for i in 0..4 {
                if all || old.eoi_exit[i] != new.eoi_exit[i] {
                    self.eoi_exit[i] = new.eoi_exit[i];
                }
            }
        }
        assert_eq!(
            self.state(),
            lapic.image(),
            "after an entry, the page and the VMCS hold the model's state"
        );
        for o in PAGE_REGISTERS {
            assert_eq!(
                self.word(o),
                lapic.read(o, 0),
                "after an entry, the page shows the model's register at {o:#x}"
            );
        }
        self.ppr_virtualization();
        given
    }

    /// A VM exit: the state taken back as `virtual_apic::take_back` does (nothing when the
    /// model has nothing handed over, as after an INIT). What `take_back` returns.
    pub fn exit(&self, lapic: &mut Lapic) -> bool {
        if !lapic.handed_over() {
            return false;
        }
        lapic.take_back(self.status, self.word(reg::TPR), |o| self.word(o))
    }

    /// PPR virtualization (§29.1.3): VPPR from VTPR and SVI.
    fn ppr_virtualization(&mut self) {
        let (tpr, svi) = (self.word(reg::TPR), u32::from(self.svi()));
        let vppr = if (tpr >> 4) & 0xf >= (svi >> 4) & 0xf {
            tpr & 0xff
        } else {
            svi & 0xf0
        };
        self.set_word(reg::PPR, vppr);
    }

    /// Evaluation of pending virtual interrupts (§29.2.1): the vector recognized (RVI, if its
    /// priority class is above VPPR's), which the CPU delivers as soon as the guest can take
    /// an interrupt.
    pub fn recognized(&self) -> Option<u8> {
        let rvi = self.rvi();
        (u32::from(rvi >> 4) > (self.word(reg::PPR) >> 4) & 0xf).then_some(rvi)
    }

    /// Virtual-interrupt delivery (§29.2.2), if an interrupt is recognized (the guest has
    /// RFLAGS.IF set and no blocking): the vector delivered.
    pub fn deliver(&mut self) -> Option<u8> {
        let v = self.recognized()?;
        self.set_bit(reg::ISR, v, true);
        self.set_svi(v);
        self.set_word(reg::PPR, u32::from(v) & 0xf0);
        self.set_bit(reg::IRR, v, false);
        let rvi = self.highest(reg::IRR).unwrap_or(0);
        self.set_rvi(rvi);
        Some(v)
    }

    /// The guest writes EOI (0B0H): EOI virtualization (§29.1.4). The vector ended (SVI; 0 if
    /// none was in service) and whether the EOI-exit bitmap makes it an EOI-induced VM exit
    /// (trap-like, after the EOI is done).
    pub fn eoi(&mut self) -> (u8, bool) {
        self.set_word(reg::EOI, 0);
        let v = self.svi();
        self.set_bit(reg::ISR, v, false);
        let svi = self.highest(reg::ISR).unwrap_or(0);
        self.set_svi(svi);
        self.ppr_virtualization();
        let exits = self.eoi_exit[usize::from(v / 64)] & 1 << (v % 64) != 0;
        // Else pending virtual interrupts are evaluated: `recognized` is that.
        (v, exits)
    }

    /// The guest writes TPR (080H): bytes 3:1 of VTPR cleared, then TPR virtualization
    /// (§29.4.3.2, §29.1.2).
    pub fn write_tpr(&mut self, value: u32) {
        self.set_word(reg::TPR, value & 0xff);
        self.ppr_virtualization();
    }

    /// The guest writes ICR's low half (300H): the CPU virtualizes a self-IPI (fixed, edge,
    /// shorthand self, vector 16-255, reserved bits 0) itself (§29.4.3.2, §29.1.5: VIRR bit set,
    /// RVI raised to it if below); any other command is an APIC-write VM exit, for the VMM to
    /// send (false).
    pub fn write_icr_low(&mut self, value: u32) -> bool {
        self.set_word(reg::ICR_LOW, value);
        let self_ipi = value & ICR_MUST_BE_ZERO == 0
            && (value >> 18) & 3 == 1
            && value & (1 << 15) == 0
            && (value >> 8) & 7 == 0
            && value & 0xf0 != 0;
        if self_ipi {
            let v = value as u8;
            self.set_bit(reg::IRR, v, true);
            if v > self.rvi() {
                self.set_rvi(v);
            }
        }
        self_ipi
    }

    /// A self-IPI of `vector` (fixed, edge), as Linux sends one (`apic->send_IPI_self`):
    /// whether the CPU virtualized it.
    pub fn self_ipi(&mut self, vector: u8) -> bool {
        self.write_icr_low(1 << 18 | u32::from(vector))
    }

    /// The guest writes ICR's high half (310H): bytes 2:0 cleared, no exit (§29.4.3.2).
    pub fn write_icr_high(&mut self, value: u32) {
        self.set_word(reg::ICR_HIGH, value & 0xff00_0000);
    }
}

mod tests {
    use super::*;

    /// The model follows the SDM's pseudocode on a small case: a delivery, a self-IPI below
    /// RVI, a TPR that blocks, EOIs.
    #[test]
    fn the_cpu_model_does_what_the_sdm_says() {
        let mut c = CpuVapic::new();
        c.set_bit(reg::IRR, 0x50, true);
        c.set_bit(reg::IRR, 0x31, true);
        c.status = 0x50;
        c.ppr_virtualization();
        assert_eq!(c.recognized(), Some(0x50));
        assert_eq!(c.deliver(), Some(0x50));
        assert_eq!((c.rvi(), c.svi(), c.word(reg::PPR)), (0x31, 0x50, 0x50));
        assert_eq!(c.deliver(), None, "0x31 is below the class in service");
        assert!(c.self_ipi(0x42));
        assert_eq!(c.rvi(), 0x42, "RVI raised");
        assert!(c.self_ipi(0x33));
        assert_eq!(c.rvi(), 0x42, "a lower self-IPI leaves RVI as it is");
        assert!(!c.self_ipi(0x0f), "vectors 0-15 exit");
        assert!(!c.write_icr_low(1 << 18 | 1 << 15 | 0x40), "level exits");
        assert!(!c.write_icr_low(3 << 18 | 0x40), "all-but-self exits");
        c.write_tpr(0x7f);
        assert_eq!(c.eoi(), (0x50, false));
        assert_eq!((c.svi(), c.word(reg::PPR)), (0, 0x7f));
        assert_eq!(c.recognized(), None, "TPR blocks 0x42");
        c.write_tpr(0x0100_0030);
        assert_eq!(c.word(reg::TPR), 0x30);
        assert_eq!(c.deliver(), Some(0x42));
        assert_eq!(c.vectors(reg::IRR), [0x31, 0x33]);
        assert_eq!(c.rvi(), 0x33);
        c.eoi_exit[1] = 1 << 2;
        assert_eq!(c.eoi(), (0x42, true), "0x42's EOI exits");
        c.write_icr_high(0x0312_3456);
        assert_eq!(c.word(reg::ICR_HIGH), 0x0300_0000);
    }
}
