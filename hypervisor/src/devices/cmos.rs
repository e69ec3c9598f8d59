//! The MC146818 real-time clock and CMOS RAM of a PC (ports 0x70 index, 0x71 data), per the
//! Motorola MC146818 data sheet: time and date registers 0-9 that advance with the host TSC from a
//! fixed start, status registers A-D (update-in-progress never set: an update takes no time
//! here), the century at 0x32, and the rest as RAM.

/// Registers.
const SECONDS: u8 = 0x00;
const MINUTES: u8 = 0x02;
const HOURS: u8 = 0x04;
const WEEKDAY: u8 = 0x06;
const DAY: u8 = 0x07;
const MONTH: u8 = 0x08;
const YEAR: u8 = 0x09;
const STATUS_A: u8 = 0x0a;
const STATUS_B: u8 = 0x0b;
const STATUS_C: u8 = 0x0c;
const STATUS_D: u8 = 0x0d;
const CENTURY: u8 = 0x32;
/// Status B: 24-hour mode (bit 1); data mode binary (bit 2) when set, else BCD.
const B_24H: u8 = 0x02;
const B_BINARY: u8 = 0x04;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cmos {
    index: u8,
    /// The clock at TSC 0 (seconds since 1970), and the TSC frequency.
    start: u64,
    tsc_hz: u64,
    status_b: u8,
    ram: [u8; 128],
}

impl Cmos {
    /// A clock that reads `unix_seconds` at TSC 0 and advances at `tsc_hz`.
    pub fn new(unix_seconds: u64, tsc_hz: u64) -> Self {
        Cmos {
            index: 0,
            start: unix_seconds,
            tsc_hz: tsc_hz.max(1),
            status_b: B_24H,
            ram: [0; 128],
        }
    }

    /// A guest OUT to 0x70 (index; bit 7 is the NMI mask, ignored) or 0x71.
    pub fn write(&mut self, port: u16, value: u8, _now: u64) {
        match port {
            0x70 => self.index = value & 0x7f,
            0x71 => match self.index {
                STATUS_B => self.status_b = value,
                STATUS_A | STATUS_C | STATUS_D => {}
                // Setting the time is not offered: the clock follows the host TSC.
                SECONDS..=YEAR => {}
                i => self.ram[usize::from(i)] = value,
            },
            _ => {}
        }
    }

    /// A guest IN from 0x70 or 0x71.
    pub fn read(&mut self, port: u16, now: u64) -> u8 {
        if port != 0x71 {
            return 0xff;
        }
        let secs = self.start + now / self.tsc_hz;
        let (year, month, day) = civil(secs / 86_400);
        let time = secs % 86_400;
        let enc = |v: u64| {
            let v = v as u8;
            if self.status_b & B_BINARY != 0 {
                v
            } else {
                ((v / 10) << 4) | (v % 10)
            }
        };
        match self.index {
            SECONDS => enc(time % 60),
            MINUTES => enc(time / 60 % 60),
            HOURS => {
                let h = time / 3600;
                if self.status_b & B_24H != 0 {
                    enc(h)
                } else {
                    // 12-hour mode: 1-12, bit 7 for PM.
                    let pm = if h >= 12 { 0x80 } else { 0 };
                    enc((h + 11) % 12 + 1) | pm
                }
            }
            // 1 = Sunday; 1970-01-01 was a Thursday.
            WEEKDAY => enc((secs / 86_400 + 4) % 7 + 1),
            DAY => enc(day),
            MONTH => enc(month),
            YEAR => enc(year % 100),
            CENTURY => enc(year / 100),
            // Divider 010 (32.768 kHz), rate 0110; update in progress never set.
            STATUS_A => 0x26,
            STATUS_B => self.status_b,
            STATUS_C => 0,
            // Valid RAM and time.
            STATUS_D => 0x80,
            i => self.ram[usize::from(i)],
        }
    }
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year as u64, month as u64, day as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(c: &mut Cmos, i: u8, now: u64) -> u8 {
        c.write(0x70, i, now);
        c.read(0x71, now)
    }

    #[test]
    fn time_and_date_in_bcd_advance_with_the_tsc() {
        // 2026-01-01 00:00:00 UTC, a Thursday; TSC at 1 MHz.
        let mut c = Cmos::new(1_767_225_600, 1_000_000);
        assert_eq!(reg(&mut c, YEAR, 0), 0x26);
        assert_eq!(reg(&mut c, CENTURY, 0), 0x20);
        assert_eq!((reg(&mut c, MONTH, 0), reg(&mut c, DAY, 0)), (0x01, 0x01));
        assert_eq!(reg(&mut c, WEEKDAY, 0), 5);
        // 1 h 2 min 3 s later.
        let t = 3723 * 1_000_000;
        assert_eq!(
            (
                reg(&mut c, HOURS, t),
                reg(&mut c, MINUTES, t),
                reg(&mut c, SECONDS, t)
            ),
            (0x01, 0x02, 0x03)
        );
        assert_eq!(reg(&mut c, STATUS_A, t) & 0x80, 0, "never updating");
        assert_eq!(reg(&mut c, STATUS_D, t), 0x80);
        // Binary mode on request; RAM reads back; the NMI bit of the index is ignored.
        c.write(0x70, STATUS_B, 0);
        c.write(0x71, B_24H | B_BINARY, 0);
        assert_eq!(reg(&mut c, SECONDS, t), 3);
        c.write(0x70, 0x80 | 0x40, 0);
        c.write(0x71, 0x5a, 0);
        assert_eq!(reg(&mut c, 0x40, 0), 0x5a);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(11_016), (2000, 2, 29));
        assert_eq!(civil(20_454), (2026, 1, 1));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(ops in proptest::collection::vec((proptest::bool::ANY, proptest::num::u8::ANY, proptest::num::u64::ANY), 0..100)) {
            let mut c = Cmos::new(1_767_225_600, 4_000_000);
            for (w, v, now) in ops {
                if w { c.write(0x70 + u16::from(v & 1), v, now); } else { c.read(0x70 + u16::from(v & 1), now); }
            }
        }
    }
}
