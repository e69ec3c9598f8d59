//! The ACPI PM1a event and control blocks and the PM timer of a guest with ACPI tables
//! (`guest_acpi`): the guest finds the platform in ACPI mode (SCI_EN set), may enable and
//! acknowledge fixed events (none ever fires: no power button, no timer overflow event, no RTC
//! alarm), reads the PM timer, a 24-bit count at 3.579545 MHz made from the TSC (§4.8.3.3, "Power
//! Management Timer"; the FADT says 24 bits: TMR_VAL_EXT clear), and powers the VM off by
//! writing S5's SLP_TYP with SLP_EN.
//!
//! ACPI 6.5 §4.8.3.1 "PM1 Event Grouping" (PM1 status: write 1 to clear; PM1 enable), §4.8.3.2
//! "PM1 Control Grouping" (SCI_EN bit 0, SLP_TYPx bits 12:10, SLP_EN bit 13, write-only),
//! §7.4.2 "\_Sx (System States)".

use crate::guest_acpi::{PM_TMR, PM1A_CNT, PM1A_EVT, SLP_TYP_S5};

/// The PM timer's frequency (ACPI 6.5 §4.8.3.3).
pub const PM_TIMER_HZ: u64 = 3_579_545;

/// Whether `port` is one of the PM timer's four.
#[must_use]
pub fn is_pm_timer(port: u16) -> bool {
    (PM_TMR..PM_TMR + 4).contains(&port)
}

/// An IN of `size` bytes at `port` of the PM timer at TSC `now`, the TSC running at `tsc_hz`:
/// the count since TSC 0, 24 bits.
#[must_use]
pub fn pm_timer_read(port: u16, size: u8, now: u64, tsc_hz: u64) -> u32 {
    let count = (u128::from(now) * u128::from(PM_TIMER_HZ) / u128::from(tsc_hz.max(1))) as u32
        & 0x00ff_ffff;
    let shift = 8 * u32::from(port - PM_TMR);
    let v = count.checked_shr(shift).unwrap_or(0);
    match size {
        1 => v & 0xff,
        2 => v & 0xffff,
        _ => v,
    }
}

/// PM1_CNT.SCI_EN: the platform is in ACPI mode.
const SCI_EN: u16 = 1;
const SLP_EN: u16 = 1 << 13;

/// What a write asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmEffect {
    None,
    /// S5: the guest powered off.
    PowerOff,
    /// Another sleep state, which is not offered: the write is ignored.
    SleepRefused(u8),
}

#[derive(Clone, Copy, Debug, Default)]
pub struct AcpiPm {
    status: u16,
    enable: u16,
    /// PM1_CNT without SCI_EN and the write-only SLP_EN.
    control: u16,
}

impl AcpiPm {
    /// Whether `port` is one of the blocks' (PM1a_EVT: 4 bytes; PM1a_CNT: 2 bytes).
    #[must_use]
    pub fn claims(port: u16) -> bool {
        (PM1A_EVT..PM1A_EVT + 4).contains(&port) || (PM1A_CNT..PM1A_CNT + 2).contains(&port)
    }

    /// The 16-bit register at the even port `base`.
    fn register(&self, base: u16) -> u16 {
        match base {
            b if b == PM1A_EVT => self.status,
            b if b == PM1A_EVT + 2 => self.enable,
            _ => self.control | SCI_EN,
        }
    }

    /// An IN of `size` bytes (1, 2 or 4) at `port`.
    #[must_use]
    pub fn read(&self, port: u16, size: u8) -> u32 {
        (0..u16::from(size)).fold(0, |v, i| {
            let p = port + i;
            if !Self::claims(p) {
                return v | 0xff << (8 * i);
            }
            let byte = (self.register(p & !1) >> (8 * (p & 1))) & 0xff;
            v | u32::from(byte) << (8 * i)
        })
    }

    /// An OUT of `size` bytes of `value` at `port`.
    pub fn write(&mut self, port: u16, size: u8, value: u32) -> PmEffect {
        let mut effect = PmEffect::None;
        for i in 0..u16::from(size) {
            let p = port + i;
            if !Self::claims(p) {
                continue;
            }
            let byte = ((value >> (8 * i)) & 0xff) as u16;
            let shift = 8 * (p & 1);
            let base = p & !1;
            if base == PM1A_EVT {
                // Write 1 to clear.
                self.status &= !(byte << shift);
            } else if base == PM1A_EVT + 2 {
                self.enable = (self.enable & !(0xff << shift)) | byte << shift;
            } else {
                let full = (self.control & !(0xff << shift)) | byte << shift;
                if full & SLP_EN != 0 {
                    let typ = ((full >> 10) & 7) as u8;
                    effect = if typ == SLP_TYP_S5 {
                        PmEffect::PowerOff
                    } else {
                        PmEffect::SleepRefused(typ)
                    };
                }
                self.control = full & !(SLP_EN | SCI_EN);
            }
        }
        effect
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acpi_mode_events_and_power_off() {
        let mut pm = AcpiPm::default();
        assert_eq!(pm.read(PM1A_CNT, 2) & 1, 1, "SCI_EN: ACPI mode");
        assert_eq!(pm.read(PM1A_EVT, 2), 0);
        // Enable the RTC event (bit 10), read it back a byte at a time.
        assert_eq!(pm.write(PM1A_EVT + 2, 2, 1 << 10), PmEffect::None);
        assert_eq!(pm.read(PM1A_EVT + 2, 2), 1 << 10);
        assert_eq!(pm.read(PM1A_EVT + 3, 1), 0x04);
        assert_eq!(pm.read(PM1A_EVT, 4), (1 << 10) << 16);
        // S3 is refused, S5 powers off (Linux writes SLP_TYP then SLP_EN with it).
        assert_eq!(
            pm.write(PM1A_CNT, 2, u32::from(SLP_EN) | 3 << 10),
            PmEffect::SleepRefused(3)
        );
        assert_eq!(pm.write(PM1A_CNT, 2, 5 << 10), PmEffect::None);
        assert_eq!(
            pm.write(PM1A_CNT, 2, u32::from(SLP_EN) | 5 << 10),
            PmEffect::PowerOff
        );
        // SLP_EN reads 0; ports outside the blocks read all ones.
        assert_eq!(pm.read(PM1A_CNT, 2) & u32::from(SLP_EN), 0);
        assert_eq!(pm.read(PM1A_CNT + 1, 2) >> 8, 0xff);
        assert!(!AcpiPm::claims(PM1A_CNT + 2));
    }

    #[test]
    fn the_pm_timer_counts_at_3_579545_mhz_in_24_bits() {
        let hz = 4_000_000_000;
        assert_eq!(pm_timer_read(PM_TMR, 4, 0, hz), 0);
        // One second: 3,579,545 counts.
        assert_eq!(pm_timer_read(PM_TMR, 4, hz, hz), 3_579_545);
        // It wraps at 2^24: after 5 s, 17,897,725 mod 16,777,216.
        assert_eq!(pm_timer_read(PM_TMR, 4, 5 * hz, hz), 17_897_725 - (1 << 24));
        // Byte reads at the later ports take the higher bytes.
        assert_eq!(
            pm_timer_read(PM_TMR + 1, 1, hz, hz),
            (3_579_545 >> 8) & 0xff
        );
        assert!(is_pm_timer(0x608) && is_pm_timer(0x60b) && !is_pm_timer(0x60c));
    }
}
