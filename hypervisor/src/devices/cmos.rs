//! The PC's MC146818 real-time clock and CMOS RAM at ports 0x70 (index, bit 7 = NMI disable) and
//! 0x71 (data). Pure logic: the clock reads `unix_seconds` at TSC 0 and advances with the host
//! TSC (`now`) at `tsc_hz`; a guest that sets it shifts it by whole seconds.
//!
//! Datasheet: Motorola MC146818A Real-Time Clock Plus RAM: "Address Map" (Figure 2: registers
//! 0-9 time, alarm and date, A-D status, 14-63 user RAM; a PC's chipset extends the RAM to 127),
//! "Time, Calendar and Alarm Locations" (Table 2: binary or BCD, 12- or 24-hour), "Register A"
//! (UIP, DV2-DV0, RS3-RS0), "Register B" (SET, PIE, AIE, UIE, SQWE, DM, 24/12, DSE), "Register C"
//! (IRQF, PF, AF, UF; cleared by reading), "Register D" (VRT), "Update Cycle". The century byte at
//! 0x32 is the IBM PC/AT convention.
//!
//! Model choices:
//! - An update cycle takes no time, so UIP (register A bit 7) always reads 0: Linux's
//!   `mc146818_get_time` never waits.
//! - Registers 0-9 and the century are computed from the clock when read, in the data mode and
//!   hour format register B selects at that moment. While SET (register B bit 7) is 1 they hold
//!   still and take the guest's writes; clearing SET starts the clock from them. A write to a time
//!   register with SET clear sets that field at once. Out-of-range fields are clamped.
//! - Register C reports UF after each second and PF after each periodic-interrupt period that
//!   passed since it was last read; AF is never set, and no interrupt line is driven (IRQ 8 is
//!   not wired). The divider (DV2-DV0) is kept but does not stop the clock.
//! - Registers 1, 3 and 5 (alarms) and the RAM bytes 0x0e-0x7f except the century read back what
//!   was written.

/// The index port (write-only on a PC: reads 0xff).
pub const INDEX: u16 = 0x70;
/// The data port.
pub const DATA: u16 = 0x71;

/// Register numbers (the index).
pub const SECONDS: u8 = 0x00;
pub const SECONDS_ALARM: u8 = 0x01;
pub const MINUTES: u8 = 0x02;
pub const MINUTES_ALARM: u8 = 0x03;
pub const HOURS: u8 = 0x04;
pub const HOURS_ALARM: u8 = 0x05;
pub const WEEKDAY: u8 = 0x06;
pub const DAY: u8 = 0x07;
pub const MONTH: u8 = 0x08;
pub const YEAR: u8 = 0x09;
pub const STATUS_A: u8 = 0x0a;
pub const STATUS_B: u8 = 0x0b;
pub const STATUS_C: u8 = 0x0c;
pub const STATUS_D: u8 = 0x0d;
/// The century (BCD or binary like the year), IBM PC/AT.
pub const CENTURY: u8 = 0x32;

/// Register A after reset by a PC BIOS: 32.768 kHz time base (DV = 010), 1024 Hz rate (0110).
const A_DEFAULT: u8 = 0x26;
const B_SET: u8 = 0x80;
const B_PIE: u8 = 0x40;
const B_AIE: u8 = 0x20;
const B_UIE: u8 = 0x10;
const B_BINARY: u8 = 0x04;
const B_24H: u8 = 0x02;
const C_IRQF: u8 = 0x80;
const C_PF: u8 = 0x40;
const C_UF: u8 = 0x10;
/// Register D: valid RAM and time.
const D_VRT: u8 = 0x80;

/// The calendar fields of a moment (binary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fields {
    sec: u8,
    min: u8,
    hour: u8,
    /// 1-7, Sunday = 1.
    wday: u8,
    day: u8,
    month: u8,
    year: i64,
}

impl Fields {
    fn of(secs: u64) -> Self {
        let days = secs / 86_400;
        let time = secs % 86_400;
        let (year, month, day) = civil(days as i64);
        Fields {
            sec: (time % 60) as u8,
            min: (time / 60 % 60) as u8,
            hour: (time / 3600) as u8,
            // 1970-01-01 was a Thursday (5).
            wday: ((days + 4) % 7 + 1) as u8,
            day,
            month,
            year,
        }
    }

    /// Seconds since 1970 (clamped at 0), fields out of range clamped.
    fn seconds(&self) -> u64 {
        let days = days_from_civil(self.year, self.month.clamp(1, 12), self.day.clamp(1, 31));
        let s = i128::from(days) * 86_400
            + i128::from(self.hour.min(23)) * 3600
            + i128::from(self.min.min(59)) * 60
            + i128::from(self.sec.min(59));
        u64::try_from(s.max(0)).unwrap_or(u64::MAX)
    }
}

/// The MC146818 and the PC's CMOS RAM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cmos {
    index: u8,
    nmi_disabled: bool,
    /// The clock at TSC 0 (seconds since 1970) and the TSC frequency.
    start: u64,
    tsc_hz: u64,
    /// Seconds the guest moved the clock by.
    shift: i64,
    /// The time registers while SET holds them.
    held: Option<Fields>,
    reg_a: u8,
    reg_b: u8,
    /// The TSC of the last read of register C.
    c_read: u64,
    ram: [u8; 128],
}

impl Cmos {
    /// A clock that reads `unix_seconds` at TSC 0 and advances one second per `tsc_hz` ticks.
    pub fn new(unix_seconds: u64, tsc_hz: u64) -> Self {
        Cmos {
            index: 0,
            nmi_disabled: false,
            start: unix_seconds,
            tsc_hz: tsc_hz.max(1),
            shift: 0,
            held: None,
            reg_a: A_DEFAULT,
            reg_b: B_24H,
            c_read: 0,
            ram: [0; 128],
        }
    }

    /// Whether the guest's last index write set bit 7 (NMI disabled).
    pub fn nmi_disabled(&self) -> bool {
        self.nmi_disabled
    }

    /// The clock's seconds since 1970 at `now`.
    pub fn unix_seconds(&self, now: u64) -> u64 {
        let t = self.start.saturating_add(now / self.tsc_hz);
        t.saturating_add_signed(self.shift)
    }

    fn fields(&self, now: u64) -> Fields {
        self.held
            .unwrap_or_else(|| Fields::of(self.unix_seconds(now)))
    }

    /// Sets the clock so that it reads `f` at `now`.
    fn set(&mut self, f: Fields, now: u64) {
        let base = self.start.saturating_add(now / self.tsc_hz);
        let target = f.seconds();
        self.shift = i64::try_from(i128::from(target) - i128::from(base)).unwrap_or(0);
    }

    fn encode(&self, v: u8) -> u8 {
        if self.reg_b & B_BINARY != 0 {
            v
        } else {
            ((v / 10 % 10) << 4) | (v % 10)
        }
    }

    fn decode(&self, v: u8) -> u8 {
        if self.reg_b & B_BINARY != 0 {
            v
        } else {
            (v >> 4) * 10 + (v & 0x0f)
        }
    }

    fn encode_hour(&self, h: u8) -> u8 {
        if self.reg_b & B_24H != 0 {
            self.encode(h)
        } else {
            // 12-hour mode: 1-12, bit 7 for PM (Table 2).
            let pm = if h >= 12 { 0x80 } else { 0 };
            self.encode((h + 11) % 12 + 1) | pm
        }
    }

    fn decode_hour(&self, v: u8) -> u8 {
        if self.reg_b & B_24H != 0 {
            self.decode(v)
        } else {
            let h = self.decode(v & 0x7f) % 12;
            if v & 0x80 != 0 { h + 12 } else { h }
        }
    }

    /// A guest OUT to 0x70 (index and NMI disable) or 0x71 (the indexed register).
    pub fn write(&mut self, port: u16, value: u8, now: u64) {
        match port {
            INDEX => {
                self.index = value & 0x7f;
                self.nmi_disabled = value & 0x80 != 0;
            }
            DATA => self.write_reg(self.index, value, now),
            _ => {}
        }
    }

    fn write_reg(&mut self, reg: u8, value: u8, now: u64) {
        let mut f = self.fields(now);
        match reg {
            SECONDS => f.sec = self.decode(value),
            MINUTES => f.min = self.decode(value),
            HOURS => f.hour = self.decode_hour(value),
            // The day of the week follows from the date here.
            WEEKDAY => return,
            DAY => f.day = self.decode(value),
            MONTH => f.month = self.decode(value),
            YEAR => f.year = f.year.div_euclid(100) * 100 + i64::from(self.decode(value) % 100),
            CENTURY => f.year = i64::from(self.decode(value)) * 100 + f.year.rem_euclid(100),
            // UIP is read-only.
            STATUS_A => {
                self.reg_a = value & 0x7f;
                return;
            }
            STATUS_B => {
                let set = value & B_SET != 0;
                let mut b = value;
                if set {
                    // "UIE is cleared when SET is set"; the registers hold still.
                    b &= !B_UIE;
                    if self.held.is_none() {
                        self.held = Some(f);
                    }
                } else if let Some(held) = self.held.take() {
                    self.set(held, now);
                }
                self.reg_b = b;
                return;
            }
            // Read-only.
            STATUS_C | STATUS_D => return,
            _ => {
                self.ram[usize::from(reg & 0x7f)] = value;
                return;
            }
        }
        f.wday = Fields::of(f.seconds()).wday;
        if self.held.is_some() {
            self.held = Some(f);
        } else {
            self.set(f, now);
        }
    }

    /// A guest IN from 0x71 (the indexed register); 0x70 and other ports read 0xff.
    pub fn read(&mut self, port: u16, now: u64) -> u8 {
        if port != DATA {
            return 0xff;
        }
        let f = self.fields(now);
        match self.index {
            SECONDS => self.encode(f.sec),
            MINUTES => self.encode(f.min),
            HOURS => self.encode_hour(f.hour),
            WEEKDAY => self.encode(f.wday),
            DAY => self.encode(f.day),
            MONTH => self.encode(f.month),
            YEAR => self.encode(f.year.rem_euclid(100) as u8),
            CENTURY => self.encode(f.year.div_euclid(100).rem_euclid(100) as u8),
            STATUS_A => self.reg_a,
            STATUS_B => self.reg_b,
            STATUS_C => self.read_c(now),
            STATUS_D => D_VRT,
            i => self.ram[usize::from(i & 0x7f)],
        }
    }

    /// Register C: the flags of what happened since it was last read, cleared by this read.
    fn read_c(&mut self, now: u64) -> u8 {
        let last = core::mem::replace(&mut self.c_read, now);
        let hz = u128::from(self.tsc_hz);
        let (last, now) = (u128::from(last), u128::from(now));
        let mut c = 0;
        if self.held.is_none() && now / hz > last / hz {
            c |= C_UF;
        }
        // The periodic rate of RS3-RS0 on the 32.768 kHz time base: 2^(RS-1) cycles, with
        // RS = 1 and 2 as 8 and 9.
        let rs = self.reg_a & 0x0f;
        if rs != 0 {
            let shift = u32::from(if rs < 3 { rs + 7 } else { rs }) - 1;
            let period = |t: u128| t * 32_768 / (hz << shift);
            if period(now) > period(last) {
                c |= C_PF;
            }
        }
        let enabled = (self.reg_b & B_PIE != 0 && c & C_PF != 0)
            || (self.reg_b & B_AIE != 0 && c & 0x20 != 0)
            || (self.reg_b & B_UIE != 0 && c & C_UF != 0);
        if enabled {
            c |= C_IRQF;
        }
        c
    }
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil(days: i64) -> (i64, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as u8, day as u8)
}

/// Days since 1970-01-01 of a date (H. Hinnant's `days_from_civil`); days past the end of a
/// month roll over into the next.
fn days_from_civil(year: i64, month: u8, day: u8) -> i64 {
    let (m, d) = (i64::from(month), i64::from(day));
    let y = if m <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 2026-01-01 00:00:00 UTC, a Thursday.
    const NEW_YEAR_2026: u64 = 1_767_225_600;
    const HZ: u64 = 1_000_000;

    fn reg(c: &mut Cmos, i: u8, now: u64) -> u8 {
        c.write(INDEX, i, now);
        c.read(DATA, now)
    }

    fn put(c: &mut Cmos, i: u8, v: u8, now: u64) {
        c.write(INDEX, i, now);
        c.write(DATA, v, now);
    }

    #[test]
    fn bcd_time_and_date_advance_with_the_tsc() {
        let mut c = Cmos::new(NEW_YEAR_2026, HZ);
        assert_eq!(reg(&mut c, YEAR, 0), 0x26);
        assert_eq!(reg(&mut c, CENTURY, 0), 0x20);
        assert_eq!((reg(&mut c, MONTH, 0), reg(&mut c, DAY, 0)), (0x01, 0x01));
        assert_eq!(reg(&mut c, WEEKDAY, 0), 5, "Thursday, Sunday = 1");
        let t = (13 * 3600 + 59 * 60 + 58) * HZ; // 13:59:58, BCD
        assert_eq!(
            (
                reg(&mut c, HOURS, t),
                reg(&mut c, MINUTES, t),
                reg(&mut c, SECONDS, t)
            ),
            (0x13, 0x59, 0x58)
        );
        // A leap day: 2028-02-29.
        let mut c = Cmos::new(1_835_395_200, HZ);
        assert_eq!((reg(&mut c, MONTH, 0), reg(&mut c, DAY, 0)), (0x02, 0x29));
    }

    #[test]
    fn status_registers_as_linux_reads_them() {
        let mut c = Cmos::new(NEW_YEAR_2026, HZ);
        for t in [0, HZ / 2, HZ - 1, HZ, 10 * HZ + 1] {
            assert_eq!(reg(&mut c, STATUS_A, t) & 0x80, 0, "UIP never set");
        }
        assert_eq!(reg(&mut c, STATUS_A, 0), 0x26);
        assert_eq!(reg(&mut c, STATUS_B, 0), B_24H, "24-hour BCD");
        assert_eq!(reg(&mut c, STATUS_D, 0), 0x80, "valid RAM and time");
        // UIP is read-only.
        put(&mut c, STATUS_A, 0xa6, 0);
        assert_eq!(reg(&mut c, STATUS_A, 0), 0x26);
    }

    #[test]
    fn binary_and_12_hour_modes() {
        let mut c = Cmos::new(NEW_YEAR_2026 + 15 * 3600 + 7, HZ);
        put(&mut c, STATUS_B, B_BINARY | B_24H, 0);
        assert_eq!((reg(&mut c, HOURS, 0), reg(&mut c, SECONDS, 0)), (15, 7));
        assert_eq!(reg(&mut c, YEAR, 0), 26);
        put(&mut c, STATUS_B, 0, 0); // BCD, 12-hour
        assert_eq!(reg(&mut c, HOURS, 0), 0x80 | 0x03, "3 PM");
        let mut c = Cmos::new(NEW_YEAR_2026 + 30 * 60, HZ);
        put(&mut c, STATUS_B, 0, 0);
        assert_eq!(reg(&mut c, HOURS, 0), 0x12, "00:30 is 12 AM");
    }

    #[test]
    fn the_guest_sets_the_clock_with_set() {
        let mut c = Cmos::new(NEW_YEAR_2026, HZ);
        // mc146818_set_time: SET, the fields, then SET cleared.
        put(&mut c, STATUS_B, B_SET | B_24H, 0);
        put(&mut c, YEAR, 0x30, 0);
        put(&mut c, MONTH, 0x07, 0);
        put(&mut c, DAY, 0x14, 0);
        put(&mut c, HOURS, 0x08, 0);
        put(&mut c, MINUTES, 0x00, 0);
        put(&mut c, SECONDS, 0x00, 0);
        // Held while SET is 1, whatever the time.
        assert_eq!(reg(&mut c, SECONDS, 5 * HZ), 0x00);
        assert_eq!(reg(&mut c, YEAR, 5 * HZ), 0x30);
        put(&mut c, STATUS_B, B_24H, 5 * HZ);
        // 2030-07-14 08:00:00 UTC from TSC 5 s on; a Sunday.
        assert_eq!(c.unix_seconds(5 * HZ), 1_910_246_400);
        assert_eq!(reg(&mut c, SECONDS, 8 * HZ), 0x03);
        assert_eq!(reg(&mut c, WEEKDAY, 8 * HZ), 1);
        // A direct write with SET clear takes effect at once.
        put(&mut c, MINUTES, 0x45, 8 * HZ);
        assert_eq!(reg(&mut c, MINUTES, 8 * HZ), 0x45);
        assert_eq!(reg(&mut c, HOURS, 8 * HZ), 0x08);
    }

    #[test]
    fn ram_alarms_and_the_nmi_bit() {
        let mut c = Cmos::new(NEW_YEAR_2026, HZ);
        for i in (0x0e..0x80u8).filter(|&i| i != CENTURY) {
            put(&mut c, i, i ^ 0xa5, 0);
        }
        put(&mut c, SECONDS_ALARM, 0x12, 0);
        for i in (0x0e..0x80u8).filter(|&i| i != CENTURY) {
            assert_eq!(reg(&mut c, i, 0), i ^ 0xa5);
        }
        assert_eq!(reg(&mut c, SECONDS_ALARM, 0), 0x12);
        c.write(INDEX, 0x80 | MINUTES_ALARM, 0);
        assert!(c.nmi_disabled());
        c.write(DATA, 0x34, 0);
        assert_eq!(c.read(DATA, 0), 0x34);
        assert_eq!(c.read(INDEX, 0), 0xff);
        c.write(INDEX, HOURS_ALARM, 0);
        assert!(!c.nmi_disabled());
    }

    #[test]
    fn register_c_flags_clear_on_read() {
        let mut c = Cmos::new(NEW_YEAR_2026, HZ);
        put(&mut c, STATUS_A, 0x20, 0); // no periodic rate
        put(&mut c, STATUS_B, B_24H | B_UIE, 0);
        assert_eq!(reg(&mut c, STATUS_C, HZ / 2), 0);
        assert_eq!(reg(&mut c, STATUS_C, HZ), C_IRQF | C_UF);
        assert_eq!(reg(&mut c, STATUS_C, HZ), 0);
        // 1024 Hz periodic flag, not enabled: PF without IRQF.
        put(&mut c, STATUS_A, 0x26, HZ);
        put(&mut c, STATUS_B, B_24H, HZ);
        assert_eq!(reg(&mut c, STATUS_C, HZ + HZ / 1024 + 1), C_PF);
    }

    #[test]
    fn dates_round_trip() {
        for days in [-1000, 0, 11_016, 20_454, 2_932_896] {
            let (y, m, d) = civil(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(civil(11_016), (2000, 2, 29));
    }

    proptest! {
        /// No sequence of port accesses panics, at any time and frequency.
        #[test]
        fn any_sequence(
            start in any::<u64>(),
            hz in any::<u64>(),
            ops in prop::collection::vec((any::<bool>(), 0x6fu16..0x73, any::<u8>(), any::<u64>()), 0..200),
        ) {
            let mut c = Cmos::new(start, hz);
            for (w, port, v, now) in ops {
                if w { c.write(port, v, now); } else { c.read(port, now); }
            }
        }

        /// Whatever the time, registers 0-9 are valid BCD in range, A never shows UIP.
        #[test]
        fn registers_are_valid_bcd(secs in 0u64..4_102_444_800, now in any::<u64>()) {
            let mut c = Cmos::new(secs, 3_000_000_000);
            let bcd = |v: u8| (v >> 4) * 10 + (v & 0xf);
            let limits = [(SECONDS, 0, 59), (MINUTES, 0, 59), (HOURS, 0, 23), (WEEKDAY, 1, 7),
                (DAY, 1, 31), (MONTH, 1, 12), (YEAR, 0, 99)];
            for (r, lo, hi) in limits {
                let v = reg(&mut c, r, now);
                prop_assert!(v & 0xf < 10 && v >> 4 < 10, "register {r}: {v:#x}");
                prop_assert!((lo..=hi).contains(&bcd(v)), "register {r}: {v:#x}");
            }
            prop_assert_eq!(reg(&mut c, STATUS_A, now) & 0x80, 0);
        }
    }
}
