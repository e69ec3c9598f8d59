//! The PC's 8254 programmable interval timer at ports 0x40-0x43, with port 0x61 (channel 2's gate,
//! the speaker enable, channel 2's OUT and the refresh toggle). Pure logic: time is the host TSC
//! (`now`), converted exactly to the 8254's 1,193,182 Hz clock with 128-bit arithmetic, and a
//! counter's value is computed from when it started, so a guest sees it count down in real time
//! between reads. Channel 0 drives IRQ 0 ([`Pit::irq0_edges`], [`Pit::next_irq0`]); channel 2 is
//! what Linux's `quick_pit_calibrate` and `pit_calibrate_tsc` read; channel 1 (DRAM refresh on
//! old PCs) counts like the others and drives nothing.
//!
//! Datasheet: Intel 8254 Programmable Interval Timer (order number 231164): "Control Word
//! Format" (Figure 7), "Write Operations" (Figure 8, the LSB/MSB flip-flop), "Read Operations"
//! (counter latch command, Figure 10; read-back command, Figures 11-14; status byte, Figure 12,
//! null count), "Mode Definitions" (modes 0-5, Figures 15-20, "Gate Pin Operations Summary"
//! Figure 21, "Minimum and Maximum Initial Counts" Figure 22). Port 0x61 follows the IBM PC/AT
//! technical reference (system control port B).
//!
//! Model choices:
//! - A count is loaded into the counting element when it is written (or at the gate's trigger),
//!   not on the next CLK pulse: OUT in mode 0 goes high N ticks after the count write rather than
//!   N + 1. The status byte's null count flag still reads 1 for the first tick.
//! - A new count written to a counting mode 2 or 3 takes effect at the end of the current period
//!   (the datasheet's mode 3 switches at the end of the current half-cycle).
//! - A count of 1, illegal in modes 2 and 3, acts as 2. BCD counting counts from 0-9999 decimal;
//!   invalid BCD digits in a count are taken modulo 10000.
//! - Channels 0 and 1 have their gates tied high as on a PC, so modes 1 and 5 never trigger on
//!   them; channel 2's gate is port 0x61 bit 0.
//! - Port 0x61 bit 4 toggles every 18 clocks (15.1 µs) of real time, the refresh rate a PC BIOS
//!   programs on channel 1; bits 6-7 (parity and I/O channel check) read 0.

/// The 8254's input clock (Hz).
pub const PIT_HZ: u64 = 1_193_182;
/// Channel 0's data port; channels 1 and 2 follow.
pub const CHANNEL0: u16 = 0x40;
/// The control word register.
pub const CONTROL: u16 = 0x43;
/// Clocks between two toggles of port 0x61 bit 4.
const REFRESH_TICKS: u128 = 18;

/// What a channel's counting element is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Run {
    /// Not counting (no count since the control word, gate low in modes 2 and 3, modes 1 and 5
    /// before their trigger): the counting element holds `value`, OUT is `out`.
    Stopped { value: u32, out: bool },
    /// Counting down from `n`, `offset` clocks done before `start` (the TSC of the (re)start).
    Counting { n: u32, start: u64, offset: u128 },
    /// Modes 0 and 4 with the gate low: `elapsed` clocks into `n`, frozen.
    Paused { n: u32, elapsed: u128 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Channel {
    /// The mode, 0-5 (control word modes 6 and 7 are 2 and 3).
    mode: u8,
    /// The control word's M2-M0 as written (the status byte reports them).
    mode_bits: u8,
    /// RW1-RW0: 1 LSB only, 2 MSB only, 3 LSB then MSB.
    access: u8,
    bcd: bool,
    /// The count register: the initial count, 1..=modulus (a written 0 is the modulus).
    reload: u32,
    /// A count has been written since the control word.
    loaded: bool,
    /// The LSB of a two-byte count, waiting for the MSB.
    lsb: Option<u8>,
    /// The next read of a two-byte access returns the MSB.
    read_msb: bool,
    /// The output latch (counter latch or read-back), read before the live count.
    latch: Option<u16>,
    /// A latched status byte (read-back), read before anything else.
    status: Option<u8>,
    run: Run,
    /// Modes 2 and 3: the TSC at which `reload` replaces the count now running.
    pending: Option<u64>,
    /// The TSC from which the count register has reached the counting element (null count
    /// clears); `None` while it has not.
    ce_loaded: Option<u64>,
    /// Rising edges of OUT in the current run counted so far.
    seen: u128,
    /// Edges counted but not yet reported by `irq0_edges`, and the TSC of the first of them.
    unreported: u64,
    first_unreported: Option<u64>,
}

impl Default for Channel {
    fn default() -> Self {
        Channel {
            mode: 0,
            mode_bits: 0,
            access: 3,
            bcd: false,
            reload: 0x1_0000,
            loaded: false,
            lsb: None,
            read_msb: false,
            latch: None,
            status: None,
            run: Run::Stopped {
                value: 0,
                out: false,
            },
            pending: None,
            ce_loaded: None,
            seen: 0,
            unreported: 0,
            first_unreported: None,
        }
    }
}

impl Channel {
    fn modulus(&self) -> u32 {
        if self.bcd { 10_000 } else { 0x1_0000 }
    }

    fn periodic(&self) -> bool {
        matches!(self.mode, 2 | 3)
    }

    /// The count `n` as this mode runs it.
    fn effective(&self, n: u32) -> u128 {
        let n = u128::from(n);
        if self.periodic() { n.max(2) } else { n }
    }

    /// The counting element after `d` clocks of a run from `n` (binary, 0..modulus).
    fn value_at(&self, n: u32, d: u128) -> u32 {
        let m = u128::from(self.modulus());
        let n = self.effective(n);
        let v = match self.mode {
            2 => n - d % n,
            // Decrements by two: twice from N down to 2 in each period.
            3 => n - (2 * d) % n,
            // Modes 0, 1, 4, 5 count through zero and wrap.
            _ => (n % m + m - d % m) % m,
        };
        (v % m) as u32
    }

    /// OUT after `d` clocks of a run from `n`.
    fn out_at(&self, n: u32, d: u128) -> bool {
        let n = self.effective(n);
        match self.mode {
            0 | 1 => d >= n,
            2 => d % n != n - 1,
            3 => d % n < n.div_ceil(2),
            _ => d != n,
        }
    }

    /// Rising edges of OUT in the first `d` clocks of a run from `n` (inclusive of an edge at `d`).
    fn edges_at(&self, n: u32, d: u128) -> u128 {
        let n = self.effective(n);
        match self.mode {
            0 | 1 => u128::from(d >= n),
            2 | 3 => d / n,
            _ => u128::from(d > n),
        }
    }

    /// The clock count at which rising edge `k` (from 1) of a run from `n` happens.
    fn edge_tick(&self, n: u32, k: u128) -> Option<u128> {
        let n = self.effective(n);
        match (self.mode, k) {
            (0 | 1, 1) => Some(n),
            (2 | 3, _) => k.checked_mul(n),
            (4 | 5, 1) => Some(n + 1),
            _ => None,
        }
    }
}

/// The 8254 of a PC and port 0x61.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pit {
    tsc_hz: u64,
    channels: [Channel; 3],
    /// Port 0x61 bits 0-3 as written (gate 2, speaker data, parity and channel check enables).
    port61: u8,
}

impl Pit {
    /// A PIT whose clock is derived from a TSC running at `tsc_hz`.
    pub fn new(tsc_hz: u64) -> Self {
        Pit {
            tsc_hz: tsc_hz.max(1),
            channels: [Channel::default(); 3],
            port61: 0,
        }
    }

    /// Whole 8254 clocks in `[start, now)`.
    fn ticks(&self, start: u64, now: u64) -> u128 {
        u128::from(now.saturating_sub(start)) * u128::from(PIT_HZ) / u128::from(self.tsc_hz)
    }

    /// The first TSC by which `ticks` clocks after `start` have passed.
    fn tsc_after(&self, start: u64, ticks: u128) -> u64 {
        let t = ticks
            .checked_mul(u128::from(self.tsc_hz))
            .map_or(u128::MAX, |x| x.div_ceil(u128::from(PIT_HZ)));
        start.saturating_add(u64::try_from(t).unwrap_or(u64::MAX))
    }

    fn gate(&self, i: usize) -> bool {
        i != 2 || self.port61 & 1 != 0
    }

    /// The clocks channel `i` has counted in its current run at `now`, with the count it runs.
    fn progress(&self, i: usize, now: u64) -> Option<(u32, u128)> {
        match self.channels[i].run {
            Run::Stopped { .. } => None,
            Run::Counting { n, start, offset } => {
                Some((n, offset.saturating_add(self.ticks(start, now))))
            }
            Run::Paused { n, elapsed } => Some((n, elapsed)),
        }
    }

    /// Channel `i`'s counting element at `now` (binary).
    fn value(&self, i: usize, now: u64) -> u32 {
        let c = &self.channels[i];
        match (c.run, self.progress(i, now)) {
            (Run::Stopped { value, .. }, _) => value % c.modulus(),
            (_, Some((n, d))) => c.value_at(n, d),
            _ => 0,
        }
    }

    /// Channel `i`'s OUT at `now`.
    fn out(&self, i: usize, now: u64) -> bool {
        let c = &self.channels[i];
        match (c.run, self.progress(i, now)) {
            (Run::Stopped { out, .. }, _) => out,
            (_, Some((n, d))) => c.out_at(n, d),
            _ => true,
        }
    }

    /// The TSC of rising edge `k` of channel `i`'s current run, when it is counting.
    fn edge_tsc(&self, i: usize, k: u128) -> Option<u64> {
        let c = &self.channels[i];
        let Run::Counting { n, start, offset } = c.run else {
            return None;
        };
        let tick = c.edge_tick(n, k)?;
        Some(self.tsc_after(start, tick.saturating_sub(offset)))
    }

    /// Counts channel `i`'s OUT edges up to `now` into its unreported edges.
    fn count_edges(&mut self, i: usize, now: u64) {
        let Some((n, d)) = self.progress(i, now) else {
            return;
        };
        let c = &self.channels[i];
        let total = c.edges_at(n, d);
        if total > c.seen {
            let first = self.edge_tsc(i, c.seen + 1).unwrap_or(now);
            let c = &mut self.channels[i];
            if c.unreported == 0 {
                c.first_unreported = Some(first);
            }
            let new = u64::try_from(total - c.seen).unwrap_or(u64::MAX);
            c.unreported = c.unreported.saturating_add(new);
            c.seen = total;
        }
    }

    /// Brings channel `i` up to `now` before a change: edges so far are counted, and a new count
    /// waiting for the end of a period in modes 2 and 3 takes over when that end has come.
    fn settle(&mut self, i: usize, now: u64) {
        if let Some(at) = self.channels[i].pending
            && now >= at
        {
            self.count_edges(i, at);
            let c = &mut self.channels[i];
            c.run = Run::Counting {
                n: c.reload,
                start: at,
                offset: 0,
            };
            c.pending = None;
            c.seen = 0;
        }
        self.count_edges(i, now);
    }

    /// Starts channel `i` counting `n` from `now` (a new run).
    fn start(&mut self, i: usize, n: u32, now: u64) {
        let c = &mut self.channels[i];
        c.run = Run::Counting {
            n,
            start: now,
            offset: 0,
        };
        c.pending = None;
        c.seen = 0;
    }

    /// One clock after `now`: when a count written now reaches the counting element.
    fn next_clock(&self, now: u64) -> u64 {
        self.tsc_after(now, 1)
    }

    /// A guest OUT to 0x40-0x43; other ports are ignored.
    pub fn write(&mut self, port: u16, value: u8, now: u64) {
        match port {
            CONTROL => self.control(value, now),
            0x40..=0x42 => self.write_count(usize::from(port - CHANNEL0), value, now),
            _ => {}
        }
    }

    /// A byte of a count (Figure 8): LSB, MSB, or LSB then MSB as the control word said.
    fn write_count(&mut self, i: usize, value: u8, now: u64) {
        self.settle(i, now);
        let c = &mut self.channels[i];
        let raw = match (c.access, c.lsb) {
            (1, _) => u16::from(value),
            (2, _) => u16::from(value) << 8,
            (_, None) => {
                c.lsb = Some(value);
                if c.mode == 0 {
                    // Mode 0: "writing the first byte disables counting. OUT is set low
                    // immediately (no clock pulse required)".
                    let v = self.value(i, now);
                    self.channels[i].run = Run::Stopped {
                        value: v,
                        out: false,
                    };
                }
                return;
            }
            (_, Some(lsb)) => {
                c.lsb = None;
                u16::from(lsb) | u16::from(value) << 8
            }
        };
        let m = c.modulus();
        let n = if c.bcd {
            let d = |s: u32| u32::from(raw >> s & 0xf);
            (d(12) * 1000 + d(8) * 100 + d(4) * 10 + d(0)) % m
        } else {
            u32::from(raw)
        };
        c.reload = if n == 0 { m } else { n };
        c.loaded = true;
        let gate = self.gate(i);
        let c = self.channels[i];
        match c.mode {
            // Modes 0 and 4: the new count (re)starts counting; the gate only pauses it.
            0 | 4 => {
                self.start(i, c.reload, now);
                if !gate {
                    self.channels[i].run = Run::Paused {
                        n: c.reload,
                        elapsed: 0,
                    };
                }
                self.channels[i].ce_loaded = Some(self.next_clock(now));
            }
            // Modes 1 and 5: the count waits for the gate's next trigger.
            1 | 5 => self.channels[i].ce_loaded = None,
            // Modes 2 and 3: the first count starts at once; later ones at the end of the period.
            _ => match c.run {
                Run::Counting { .. } => {
                    let at = self.edge_tsc(i, c.seen + 1).unwrap_or(now);
                    let c = &mut self.channels[i];
                    c.pending = Some(at);
                    c.ce_loaded = Some(at);
                }
                _ if gate => {
                    self.start(i, c.reload, now);
                    self.channels[i].ce_loaded = Some(self.next_clock(now));
                }
                // Gate low: loaded, OUT high, counting waits for the gate.
                _ => {
                    let at = self.next_clock(now);
                    let c = &mut self.channels[i];
                    c.run = Run::Stopped {
                        value: c.reload,
                        out: true,
                    };
                    c.ce_loaded = Some(at);
                }
            },
        }
    }

    /// A write to the control word register: a mode, a counter latch or a read-back command.
    fn control(&mut self, v: u8, now: u64) {
        let sc = usize::from(v >> 6);
        if sc == 3 {
            // Read-back (Figure 11): COUNT (bit 5) and STATUS (bit 4) are active low; bits 3-1
            // select counters 2-0.
            for i in 0..3 {
                if v & (2 << i) != 0 {
                    self.settle(i, now);
                    if v & 0x10 == 0 && self.channels[i].status.is_none() {
                        self.channels[i].status = Some(self.status_byte(i, now));
                    }
                    if v & 0x20 == 0 {
                        self.latch(i, now);
                    }
                }
            }
            return;
        }
        self.settle(sc, now);
        let access = (v >> 4) & 3;
        if access == 0 {
            self.latch(sc, now);
            return;
        }
        let mode_bits = (v >> 1) & 7;
        let mode = if mode_bits >= 6 {
            mode_bits - 4
        } else {
            mode_bits
        };
        let value = self.value(sc, now);
        let c = &mut self.channels[sc];
        // "When a Control Word is written to a Counter, all Control Logic is immediately reset
        // and OUT goes to a known initial state": low in mode 0, high otherwise.
        *c = Channel {
            mode,
            mode_bits,
            access,
            bcd: v & 1 != 0,
            run: Run::Stopped {
                value,
                out: mode != 0,
            },
            unreported: c.unreported,
            first_unreported: c.first_unreported,
            ..Channel::default()
        };
    }

    /// The counter latch command: the first latch holds until read (Figure 10).
    fn latch(&mut self, i: usize, now: u64) {
        if self.channels[i].latch.is_none() {
            let v = self.encoded(i, now);
            self.channels[i].latch = Some(v);
        }
    }

    /// The counting element as the guest reads it (BCD-encoded in BCD mode).
    fn encoded(&self, i: usize, now: u64) -> u16 {
        let v = self.value(i, now);
        if self.channels[i].bcd {
            let v = v % 10_000;
            let mut bcd = 0u16;
            for (shift, div) in [(12, 1000), (8, 100), (4, 10), (0, 1)] {
                bcd |= ((v / div % 10) as u16) << shift;
            }
            bcd
        } else {
            v as u16
        }
    }

    /// The status byte (Figure 12): OUT, null count, RW1-RW0, M2-M0, BCD.
    fn status_byte(&self, i: usize, now: u64) -> u8 {
        let c = &self.channels[i];
        let null = c.ce_loaded.is_none_or(|t| now < t);
        u8::from(self.out(i, now)) << 7
            | u8::from(null) << 6
            | c.access << 4
            | c.mode_bits << 1
            | u8::from(c.bcd)
    }

    /// A guest IN from 0x40-0x42 (0x43 and other ports read 0xff): a latched status, else a
    /// latched count, else the live count, a byte at a time as the access mode says.
    pub fn read(&mut self, port: u16, now: u64) -> u8 {
        let i = match port {
            0x40..=0x42 => usize::from(port - CHANNEL0),
            _ => return 0xff,
        };
        self.settle(i, now);
        if let Some(s) = self.channels[i].status.take() {
            return s;
        }
        let live = self.encoded(i, now);
        let c = &mut self.channels[i];
        let value = c.latch.unwrap_or(live);
        let msb = match c.access {
            1 => false,
            2 => true,
            _ => {
                c.read_msb = !c.read_msb;
                !c.read_msb
            }
        };
        // A latch is released once read completely.
        if c.access != 3 || msb {
            c.latch = None;
        }
        if msb { (value >> 8) as u8 } else { value as u8 }
    }

    /// A guest IN from port 0x61: bit 0 gate 2, bit 1 speaker data, bits 2-3 as written, bit 4
    /// the refresh toggle, bit 5 channel 2's OUT.
    pub fn port61_read(&mut self, now: u64) -> u8 {
        self.settle(2, now);
        let refresh = (self.ticks(0, now) / REFRESH_TICKS) & 1 != 0;
        self.port61 & 0x0f | u8::from(refresh) << 4 | u8::from(self.out(2, now)) << 5
    }

    /// A guest OUT to port 0x61: bits 0-3 are kept; bit 0 is channel 2's gate (Figure 21): a
    /// rising edge triggers modes 1 and 5 and reloads modes 2 and 3, while low it pauses modes
    /// 0 and 4 and stops modes 2 and 3 with OUT high.
    pub fn port61_write(&mut self, value: u8, now: u64) {
        self.settle(2, now);
        let was = self.gate(2);
        self.port61 = value & 0x0f;
        let gate = self.gate(2);
        let c = self.channels[2];
        match (was, gate, c.mode) {
            (false, true, 0 | 4) => {
                if let Run::Paused { n, elapsed } = c.run {
                    self.channels[2].run = Run::Counting {
                        n,
                        start: now,
                        offset: elapsed,
                    };
                }
            }
            (false, true, _) if c.loaded => {
                self.start(2, c.reload, now);
                self.channels[2].ce_loaded = Some(self.next_clock(now));
            }
            (true, false, 0 | 4) => {
                if let Some((n, d)) = self.progress(2, now) {
                    self.channels[2].run = Run::Paused { n, elapsed: d };
                }
            }
            (true, false, 2 | 3) => {
                let v = self.value(2, now);
                let c = &mut self.channels[2];
                c.run = Run::Stopped {
                    value: v,
                    out: true,
                };
                c.pending = None;
            }
            _ => {}
        }
    }

    /// The rising edges of channel 0's OUT (IRQ 0) since the last call: one per period in modes
    /// 2 and 3, one at terminal count in mode 0, one after the strobe in mode 4.
    pub fn irq0_edges(&mut self, now: u64) -> u64 {
        self.settle(0, now);
        let c = &mut self.channels[0];
        c.first_unreported = None;
        core::mem::take(&mut c.unreported)
    }

    /// The TSC of the first rising edge of channel 0's OUT that `irq0_edges` has not reported
    /// (at or before `now` when one is due), or `None` when none will come: channel 0
    /// unprogrammed, or its one-shot already fired.
    pub fn next_irq0(&self, now: u64) -> Option<u64> {
        let c = &self.channels[0];
        if c.unreported > 0 {
            return c.first_unreported.or(Some(now));
        }
        self.edge_tsc(0, c.seen + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A 4 MHz TSC: 3.35 TSC ticks per PIT clock.
    const HZ: u64 = 4_000_000;

    /// Control word for channel `ch`, LSB then MSB, `mode`, binary; then the count.
    fn load(p: &mut Pit, ch: u16, mode: u8, count: u16, now: u64) {
        p.write(CONTROL, (ch as u8) << 6 | 0x30 | mode << 1, now);
        p.write(CHANNEL0 + ch, count as u8, now);
        p.write(CHANNEL0 + ch, (count >> 8) as u8, now);
    }

    fn read16(p: &mut Pit, ch: u16, now: u64) -> u16 {
        let lo = p.read(CHANNEL0 + ch, now);
        let hi = p.read(CHANNEL0 + ch, now);
        u16::from(lo) | u16::from(hi) << 8
    }

    #[test]
    fn unprogrammed_channel_0_raises_nothing() {
        let mut p = Pit::new(HZ);
        assert_eq!(p.next_irq0(0), None);
        assert_eq!(p.irq0_edges(u64::MAX), 0);
    }

    #[test]
    fn mode_2_interrupts_once_per_period() {
        let mut p = Pit::new(HZ);
        load(&mut p, 0, 2, 11932, 1000); // Linux's HZ=100 periodic tick
        let first = p.next_irq0(1000).unwrap();
        // 11932 clocks of 1/1193182 s at 4 MHz, rounded up: 40000.4 → 40001.
        assert_eq!(first, 1000 + 40_001);
        assert_eq!(p.irq0_edges(first - 1), 0);
        assert_eq!(p.irq0_edges(first), 1);
        assert_eq!(p.irq0_edges(first), 0);
        // 23864 clocks: 80001.2 → 80002.
        assert_eq!(p.next_irq0(first), Some(1000 + 80_002));
        // Three periods at once: three edges, and the next one after them.
        let later = 1000 + 4 * 40_001 - 1;
        assert_eq!(p.irq0_edges(later), 3);
        assert!(p.next_irq0(later).unwrap() > later);
        // No drift: edge 1000 falls where 1000 periods end, exactly.
        let t = p.edge_tsc(0, 1000).unwrap();
        assert_eq!(t, 1000 + (11_932_000u64 * HZ).div_ceil(PIT_HZ));
    }

    #[test]
    fn edges_before_a_reprogramming_are_not_lost() {
        let mut p = Pit::new(HZ);
        load(&mut p, 0, 2, 11932, 0);
        // Two periods pass, then the guest switches to one-shot mode 4 (Linux's clockevent).
        let t = 2 * 40_001 + 10;
        p.write(CONTROL, 0x38, t);
        assert_eq!(p.next_irq0(t), Some(40_001), "an edge is still due");
        assert_eq!(p.irq0_edges(t), 2);
        assert_eq!(p.next_irq0(t), None, "mode 4 waits for its count");
        p.write(CHANNEL0, 100, t);
        p.write(CHANNEL0, 0, t);
        // Mode 4: OUT strobes low at 0 (after 100 clocks) and rises one clock later.
        let edge = p.next_irq0(t).unwrap();
        assert_eq!(edge, t + (101 * HZ).div_ceil(PIT_HZ));
        assert_eq!(p.irq0_edges(edge), 1);
        assert_eq!(p.next_irq0(edge), None, "one strobe per count");
        // Linux's pit_next_event writes a new count without a control word: rearmed.
        p.write(CHANNEL0, 50, edge);
        p.write(CHANNEL0, 0, edge);
        assert_eq!(p.irq0_edges(edge + 1000), 1);
    }

    #[test]
    fn mode_0_fires_once_at_terminal_count() {
        let mut p = Pit::new(HZ);
        load(&mut p, 0, 0, 1193, 0); // 1 ms
        let t = p.next_irq0(0).unwrap();
        assert_eq!(t, (1193 * HZ).div_ceil(PIT_HZ));
        assert_eq!(p.irq0_edges(t), 1);
        assert_eq!(p.next_irq0(t), None);
        assert_eq!(p.irq0_edges(t + 10_000_000), 0);
        // It keeps counting through 0 (65535 after wrapping), OUT stays high.
        p.write(CONTROL, 0x00, t + 4 * 3); // latch about 3 clocks after the terminal count
        let v = read16(&mut p, 0, t + 100_000);
        assert!((0xfffb..=0xffff).contains(&v), "{v:#x}");
        // Linux's pit_shutdown: mode 0 with count 0 is 65536 clocks (55 ms).
        load(&mut p, 0, 0, 0, 0);
        assert_eq!(p.next_irq0(0), Some((65_536 * HZ).div_ceil(PIT_HZ)));
    }

    #[test]
    fn a_new_count_in_mode_2_waits_for_the_end_of_the_period() {
        let mut p = Pit::new(PIT_HZ); // one TSC tick per clock
        load(&mut p, 0, 2, 1000, 0);
        p.write(CHANNEL0, 0xf4, 300);
        p.write(CHANNEL0, 0x01, 300); // 500
        assert_eq!(
            read16(&mut p, 0, 400),
            600,
            "the current period is unaffected"
        );
        assert_eq!(p.irq0_edges(1000), 1);
        assert_eq!(p.next_irq0(1000), Some(1500));
        assert_eq!(read16(&mut p, 0, 1100), 400);
        assert_eq!(p.irq0_edges(2000), 2);
    }

    #[test]
    fn channel_2_counts_down_in_real_time() {
        let mut p = Pit::new(PIT_HZ);
        // quick_pit_calibrate: gate 2 on, speaker off, mode 0 with 0xffff, then MSB reads.
        let v = p.port61_read(0);
        p.port61_write((v & !0x02) | 0x01, 0);
        p.write(CONTROL, 0xb0, 0);
        p.write(0x42, 0xff, 0);
        p.write(0x42, 0xff, 0);
        assert_eq!(read16(&mut p, 2, 0), 0xffff);
        assert_eq!(read16(&mut p, 2, 300), 0xffff - 300);
        assert_eq!(read16(&mut p, 2, 256 * 10), 0xffff - 2560);
        // A latch holds its value until read, whatever the time.
        p.write(CONTROL, 0x80, 400);
        p.write(CONTROL, 0x80, 500); // ignored: already latched
        assert_eq!(read16(&mut p, 2, 900), 0xffff - 400);
        assert_eq!(read16(&mut p, 2, 900), 0xffff - 900);
    }

    #[test]
    fn out2_rises_at_terminal_count_for_pit_calibrate_tsc() {
        let mut p = Pit::new(HZ);
        // pit_calibrate_tsc: gate high, mode 0, 50 ms of counts, then poll port 0x61 bit 5.
        p.port61_write(0x01, 0);
        let latch = (PIT_HZ / 20) as u16;
        p.write(CONTROL, 0xb0, 0);
        p.write(0x42, latch as u8, 0);
        assert_eq!(p.port61_read(1) & 0x20, 0, "mode 0: OUT low while counting");
        p.write(0x42, (latch >> 8) as u8, 10);
        let end = 10 + (u64::from(latch) * HZ).div_ceil(PIT_HZ);
        assert_eq!(p.port61_read(end - 1) & 0x20, 0);
        assert_eq!(p.port61_read(end) & 0x20, 0x20);
        // 50 ms at 4 MHz.
        assert!((200_000..200_020).contains(&end), "{end}");
    }

    #[test]
    fn the_gate_pauses_mode_0_and_triggers_mode_1() {
        let mut p = Pit::new(PIT_HZ);
        load(&mut p, 2, 0, 100, 0); // gate low: loaded, not counting
        assert_eq!(read16(&mut p, 2, 50), 100);
        p.port61_write(0x01, 50);
        assert_eq!(read16(&mut p, 2, 80), 70);
        p.port61_write(0x00, 80);
        assert_eq!(read16(&mut p, 2, 500), 70, "paused while the gate is low");
        p.port61_write(0x01, 500);
        assert_eq!(p.port61_read(569) & 0x20, 0);
        assert_eq!(p.port61_read(570) & 0x20, 0x20);
        // Mode 1: OUT high until triggered, low for the count after each rising edge.
        load(&mut p, 2, 1, 100, 1000);
        assert_eq!(p.port61_read(1050) & 0x20, 0x20);
        p.port61_write(0x00, 1100);
        p.port61_write(0x01, 1200);
        assert_eq!(p.port61_read(1250) & 0x20, 0);
        // Retriggered mid-count: restarts the count.
        p.port61_write(0x00, 1250);
        p.port61_write(0x01, 1260);
        assert_eq!(p.port61_read(1359) & 0x20, 0);
        assert_eq!(p.port61_read(1360) & 0x20, 0x20);
    }

    #[test]
    fn mode_3_square_wave_on_channel_2() {
        let mut p = Pit::new(PIT_HZ);
        p.port61_write(0x03, 0); // gate and speaker, as for a beep
        load(&mut p, 2, 3, 100, 0);
        let high = |p: &mut Pit, t| p.port61_read(t) & 0x20 != 0;
        assert!(high(&mut p, 0) && high(&mut p, 49));
        assert!(!high(&mut p, 50) && !high(&mut p, 99));
        assert!(high(&mut p, 100));
        // Counts by two.
        assert_eq!(read16(&mut p, 2, 110), 80);
        // Gate low: OUT high at once; gate high again reloads.
        p.port61_write(0x02, 160);
        assert!(high(&mut p, 170));
        p.port61_write(0x03, 200);
        assert!(!high(&mut p, 250));
    }

    #[test]
    fn access_modes_and_read_back() {
        let mut p = Pit::new(PIT_HZ);
        // LSB only: the MSB of the count is 0.
        p.write(CONTROL, 0x10 | 0x04, 0); // channel 0, LSB, mode 2
        p.write(CHANNEL0, 200, 0);
        assert_eq!(p.read(CHANNEL0, 50), 150);
        // MSB only.
        p.write(CONTROL, 0x60 | 0x04, 0); // channel 1, MSB, mode 2
        p.write(0x41, 0x02, 0); // 512
        assert_eq!(p.read(0x41, 256), 0x01);
        // Read-back of channel 2's status and count (status first).
        p.write(CONTROL, 0xb6, 0); // channel 2, LSB/MSB, mode 3, binary
        p.write(CONTROL, 0xc8, 5); // read-back, count and status, channel 2
        assert_eq!(
            p.read(0x42, 5),
            0x80 | 0x40 | 0x36,
            "OUT high, null count, access 3, mode 3"
        );
        p.write(0x42, 10, 6);
        p.write(0x42, 0, 6);
        p.write(CONTROL, 0xe8, 8); // status only
        assert_eq!(p.read(0x42, 8) & 0x40, 0, "count loaded: null count clear");
        assert_eq!(p.read(CONTROL, 8), 0xff);
    }

    #[test]
    fn bcd_counting() {
        let mut p = Pit::new(PIT_HZ);
        p.write(CONTROL, 0x31, 0); // channel 0, LSB/MSB, mode 0, BCD
        p.write(CHANNEL0, 0x00, 0);
        p.write(CHANNEL0, 0x10, 0); // 1000 decimal
        assert_eq!(read16(&mut p, 0, 1), 0x0999);
        assert_eq!(p.next_irq0(0), Some(1000));
    }

    #[test]
    fn port_61_bits() {
        let mut p = Pit::new(PIT_HZ);
        p.port61_write(0xff, 0);
        assert_eq!(p.port61_read(0) & 0xcf, 0x0f);
        // The refresh bit toggles every 18 clocks of real time.
        assert_eq!(p.port61_read(17) & 0x10, 0);
        assert_eq!(p.port61_read(18) & 0x10, 0x10);
        assert_eq!(p.port61_read(36) & 0x10, 0);
    }

    proptest! {
        /// No sequence of port accesses panics, time going forwards or backwards; a due edge is
        /// reported by `irq0_edges` at the time `next_irq0` named.
        #[test]
        fn any_sequence(
            hz in prop_oneof![Just(1u64), Just(PIT_HZ), Just(3_000_000_000u64), any::<u64>()],
            ops in prop::collection::vec((0u8..6, 0u16..5, any::<u8>(), any::<u64>()), 0..200),
        ) {
            let mut p = Pit::new(hz);
            for (op, port, v, now) in ops {
                match op {
                    0 | 1 => p.write(CHANNEL0 + port, v, now),
                    2 => { p.read(CHANNEL0 + port, now); }
                    3 => p.port61_write(v, now),
                    4 => { p.port61_read(now); }
                    _ => {
                        if let Some(t) = p.next_irq0(now).filter(|&t| t < u64::MAX) {
                            prop_assert!(p.irq0_edges(t) > 0);
                        }
                    }
                }
            }
        }
    }
}
