//! The hypervisor's own boot options, from the Multiboot2 command line tag.
//!
//! The command line is whitespace-separated `key=value` tokens; each known key may appear at
//! most once, anything else is an error (GRUB passes the words after the image path, so the path
//! itself is not part of it):
//!
//! | key        | values                                           | default  |
//! |------------|--------------------------------------------------|----------|
//! | `period`   | decimal number with unit `ns`, `us`, `ms`, `ticks` (TSC ticks), > 0 | `1ms` |
//! | `export`   | `stream` or `end`                                | `stream` |
//! | `selftest` | `none`, `ud`, `pagefault`, `gp`, `panic`, `channel[:records]` | `none`   |
//! | `serial`   | `0x`-prefixed hexadecimal I/O port, `0x1..=0xfff8` | `0x3f8` |
//! | `buffer`   | records kept in memory for `export=end`: `auto` or a decimal number | `auto` |
//! | `slice`    | the scheduler's time slice, as `period` | `10ms` |
//! | `channel`  | where the sample log's frames go: `serial` (the console UART, with the text), `lpt` (the parallel port at 0x378: no baud rate, for emulators) or `virtio` (a virtio console PCI device, e.g. QEMU's `virtconsole`; `serial` when there is none) | `serial` |
//!
//! [`Options`] prints in the same syntax, and `parse(&options.to_string())` gives the options
//! back.

use core::fmt;

/// The sampling period.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Period {
    /// Nanoseconds (`ns`; `us` and `ms` are converted).
    Nanos(u64),
    /// TSC ticks (`ticks`).
    Ticks(u64),
}

impl Period {
    /// The period in TSC ticks for a TSC running at `tsc_hz`, at least 1, saturating.
    pub fn to_tsc_ticks(self, tsc_hz: u64) -> u64 {
        let ticks = match self {
            Self::Ticks(t) => t,
            Self::Nanos(ns) => {
                let t = u128::from(ns) * u128::from(tsc_hz) / 1_000_000_000;
                u64::try_from(t).unwrap_or(u64::MAX)
            }
        };
        ticks.max(1)
    }
}

impl Default for Period {
    fn default() -> Self {
        Self::Nanos(1_000_000)
    }
}

impl fmt::Display for Period {
    /// The largest unit that represents the period exactly: `1ms`, `250us`, `7ns`, `100ticks`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Ticks(t) => write!(f, "{t}ticks"),
            Self::Nanos(ns) if ns != 0 && ns.is_multiple_of(1_000_000) => {
                write!(f, "{}ms", ns / 1_000_000)
            }
            Self::Nanos(ns) if ns != 0 && ns.is_multiple_of(1_000) => write!(f, "{}us", ns / 1_000),
            Self::Nanos(ns) => write!(f, "{ns}ns"),
        }
    }
}

/// How samples leave the machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Export {
    /// Drain the rings onto the serial port while running.
    #[default]
    Stream,
    /// Keep samples in memory and dump them at the end.
    End,
}

impl fmt::Display for Export {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Stream => "stream",
            Self::End => "end",
        })
    }
}

/// Where the sample log's frames go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Channel {
    /// The console's UART, interleaved with the console text (115,200 baud).
    #[default]
    Serial,
    /// The first parallel port (I/O 0x378): a byte per strobe, no baud rate. Bochs and QEMU write
    /// it to a file at the speed of a port write, whatever their emulated clock.
    Lpt,
    /// A virtio console (virtio 1.x PCI device, QEMU's `virtconsole`): whole buffers per
    /// notification; the UART keeps the console text. Falls back to `serial` when there is none.
    Virtio,
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Serial => "serial",
            Self::Lpt => "lpt",
            Self::Virtio => "virtio",
        })
    }
}

/// A deliberate fault after boot, to test the hypervisor's own handlers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SelfTest {
    /// No self-test.
    #[default]
    None,
    /// Execute `ud2` (#UD).
    Ud,
    /// Touch an unmapped address (#PF).
    PageFault,
    /// Raise a general-protection fault (#GP).
    Gp,
    /// Call `panic!`.
    Panic,
    /// Send the channel self-test's synthetic record stream (this many records) through the
    /// chosen channel and power off, before any VMX check: measures a channel where there is
    /// no VMX (QEMU TCG).
    Channel(u64),
}

/// Records `selftest=channel` sends when its count is not given.
pub const CHANNEL_TEST_RECORDS: u64 = 1_000_000;

impl fmt::Display for SelfTest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Ud => "ud",
            Self::PageFault => "pagefault",
            Self::Gp => "gp",
            Self::Panic => "panic",
            Self::Channel(n) => return write!(f, "channel:{n}"),
        })
    }
}

/// The effective boot options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Options {
    pub period: Period,
    pub export: Export,
    pub selftest: SelfTest,
    /// Base I/O port of the 16550 UART (at most 0xfff8: it uses 8 ports).
    pub serial: u16,
    /// Records the `end` export keeps in memory; 0 = automatic (a quarter of free memory).
    pub buffer: u32,
    /// The scheduler's time slice.
    pub slice: Period,
    /// Where the sample log's frames go.
    pub channel: Channel,
    /// Call chains: the deepest chain a sample carries (0 = none, the default). `stacks=on` is
    /// `DEFAULT_STACK_DEPTH`.
    pub stacks: u8,
}

/// `stacks=on`: frames per chain.
pub const DEFAULT_STACK_DEPTH: u8 = 16;

/// The deepest chain a sample may carry (the wire format's limit).
pub const MAX_STACK_DEPTH: u8 = 32;

/// The default time slice: 10 ms.
pub const DEFAULT_SLICE: Period = Period::Nanos(10_000_000);

/// The default serial port (COM1).
pub const DEFAULT_SERIAL: u16 = 0x3f8;

/// The highest accepted UART base: a 16550 occupies 8 consecutive ports.
pub const MAX_SERIAL: u16 = 0xfff8;

impl Default for Options {
    fn default() -> Self {
        Self {
            period: Period::default(),
            export: Export::default(),
            selftest: SelfTest::default(),
            serial: DEFAULT_SERIAL,
            buffer: 0,
            slice: DEFAULT_SLICE,
            channel: Channel::Serial,
            stacks: 0,
        }
    }
}

impl fmt::Display for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "period={} export={} selftest={} serial={:#x} buffer=",
            self.period, self.export, self.selftest, self.serial
        )?;
        match self.buffer {
            0 => f.write_str("auto")?,
            n => write!(f, "{n}")?,
        }
        write!(f, " slice={} channel={}", self.slice, self.channel)?;
        match self.stacks {
            0 => f.write_str(" stacks=off"),
            n => write!(f, " stacks={n}"),
        }
    }
}

/// What is wrong with a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueProblem {
    /// `period`: not digits followed by `ns`, `us`, `ms` or `ticks`.
    PeriodSyntax,
    /// `period`: zero.
    PeriodZero,
    /// `period`: the number (in nanoseconds or ticks) does not fit in 64 bits.
    PeriodTooLarge,
    /// `export`: not `stream` or `end`.
    ExportChoice,
    /// `selftest`: not one of the known faults.
    SelfTestChoice,
    /// `serial`: not `0x` followed by hexadecimal digits.
    SerialSyntax,
    /// `serial`: outside `0x1..=0xfff8`.
    SerialRange,
    /// `buffer`: not `auto` or a positive decimal number below 2^32.
    BufferSyntax,
    /// `channel`: not `serial` or `lpt`.
    ChannelChoice,
    /// `stacks`: not `off`, `on` or a depth 1..=32.
    StacksChoice,
}

impl fmt::Display for ValueProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PeriodSyntax => {
                "expected a number with unit ns, us, ms or ticks (e.g. period=1ms)"
            }
            Self::PeriodZero => "the period must be greater than zero",
            Self::PeriodTooLarge => "the period does not fit in 64 bits of nanoseconds or ticks",
            Self::ExportChoice => {
                "expected stream or end (where the log goes is channel=serial, lpt or virtio)"
            }
            Self::SelfTestChoice => {
                "expected none, ud, pagefault, gp, panic, channel or channel:<records>"
            }
            Self::SerialSyntax => "expected a hexadecimal I/O port such as 0x3f8",
            Self::SerialRange => {
                "the port must lie in 0x1..=0xfff8 (a 16550 UART uses 8 consecutive ports)"
            }
            Self::BufferSyntax => {
                "expected auto or a positive number of records (e.g. buffer=100000)"
            }
            Self::ChannelChoice => "expected serial, lpt or virtio",
            Self::StacksChoice => "expected off, on (16 frames) or a depth from 1 to 32",
        })
    }
}

/// Why [`parse`] rejected the command line. Borrowed parts point into the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmdlineError<'a> {
    /// A token without `=`.
    NotKeyValue { token: &'a str },
    /// A key this parser does not know (possibly empty, for a token starting with `=`).
    UnknownKey { key: &'a str },
    /// `key=` with nothing after the `=`.
    EmptyValue { key: &'static str },
    /// A known key given twice.
    Repeated { key: &'static str },
    /// A value the key does not accept.
    BadValue {
        key: &'static str,
        value: &'a str,
        problem: ValueProblem,
    },
}

/// The known keys, in the order of the messages.
pub const KNOWN_KEYS: [&str; 8] = [
    "period", "export", "selftest", "serial", "buffer", "slice", "channel", "stacks",
];

impl fmt::Display for CmdlineError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::NotKeyValue { token } => write!(
                f,
                "boot option '{}' is not of the form key=value",
                token.escape_debug()
            ),
            Self::UnknownKey { key } => write!(
                f,
                "unknown boot option '{}' (known: period, export, selftest, serial, buffer, slice, channel, stacks)",
                key.escape_debug()
            ),
            Self::EmptyValue { key } => write!(f, "boot option {key}= has an empty value"),
            Self::Repeated { key } => write!(f, "boot option {key} is given more than once"),
            Self::BadValue {
                key,
                value,
                problem,
            } => {
                write!(f, "boot option {key}='{}': {problem}", value.escape_debug())
            }
        }
    }
}

impl core::error::Error for CmdlineError<'_> {}

/// Parses the hypervisor's command line; keys not given keep their defaults.
pub fn parse(s: &str) -> Result<Options, CmdlineError<'_>> {
    let mut options = Options::default();
    let mut seen = [false; KNOWN_KEYS.len()];
    for token in s.split_whitespace() {
        let (key, value) = token
            .split_once('=')
            .ok_or(CmdlineError::NotKeyValue { token })?;
        let (index, key) = KNOWN_KEYS
            .into_iter()
            .enumerate()
            .find(|(_, k)| *k == key)
            .ok_or(CmdlineError::UnknownKey { key })?;
        if let Some(seen) = seen.get_mut(index) {
            if *seen {
                return Err(CmdlineError::Repeated { key });
            }
            *seen = true;
        }
        if value.is_empty() {
            return Err(CmdlineError::EmptyValue { key });
        }
        let bad = |problem| CmdlineError::BadValue {
            key,
            value,
            problem,
        };
        match key {
            "period" => options.period = parse_period(value).map_err(bad)?,
            "export" => {
                options.export = match value {
                    "stream" => Export::Stream,
                    "end" => Export::End,
                    _ => return Err(bad(ValueProblem::ExportChoice)),
                }
            }
            "selftest" => {
                options.selftest = match value {
                    "none" => SelfTest::None,
                    "ud" => SelfTest::Ud,
                    "pagefault" => SelfTest::PageFault,
                    "gp" => SelfTest::Gp,
                    "panic" => SelfTest::Panic,
                    "channel" => SelfTest::Channel(CHANNEL_TEST_RECORDS),
                    v => match v.strip_prefix("channel:").map(str::parse::<u64>) {
                        Some(Ok(n)) if n > 0 => SelfTest::Channel(n),
                        _ => return Err(bad(ValueProblem::SelfTestChoice)),
                    },
                }
            }
            "serial" => options.serial = parse_serial(value).map_err(bad)?,
            "slice" => options.slice = parse_period(value).map_err(bad)?,
            "channel" => {
                options.channel = match value {
                    "serial" => Channel::Serial,
                    "lpt" => Channel::Lpt,
                    "virtio" => Channel::Virtio,
                    _ => return Err(bad(ValueProblem::ChannelChoice)),
                }
            }
            "stacks" => {
                options.stacks = match value {
                    "off" => 0,
                    "on" => DEFAULT_STACK_DEPTH,
                    v => v
                        .parse::<u8>()
                        .ok()
                        .filter(|n| (1..=MAX_STACK_DEPTH).contains(n))
                        .filter(|_| v.bytes().all(|b| b.is_ascii_digit()))
                        .ok_or(bad(ValueProblem::StacksChoice))?,
                }
            }
            _ => {
                options.buffer = match value {
                    "auto" => 0,
                    v => v
                        .parse::<u32>()
                        .ok()
                        .filter(|&n| n > 0 && v.bytes().all(|b| b.is_ascii_digit()))
                        .ok_or(bad(ValueProblem::BufferSyntax))?,
                }
            }
        }
    }
    Ok(options)
}

fn parse_period(value: &str) -> Result<Period, ValueProblem> {
    let digits_end = value
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value
        .split_at_checked(digits_end)
        .ok_or(ValueProblem::PeriodSyntax)?;
    let scale = match unit {
        "ns" | "ticks" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        _ => return Err(ValueProblem::PeriodSyntax),
    };
    if digits.is_empty() {
        return Err(ValueProblem::PeriodSyntax);
    }
    let n = digits
        .bytes()
        .try_fold(0u64, |acc, d| {
            acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
        .and_then(|n| n.checked_mul(scale))
        .ok_or(ValueProblem::PeriodTooLarge)?;
    if n == 0 {
        return Err(ValueProblem::PeriodZero);
    }
    Ok(if unit == "ticks" {
        Period::Ticks(n)
    } else {
        Period::Nanos(n)
    })
}

fn parse_serial(value: &str) -> Result<u16, ValueProblem> {
    let hex = value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or(ValueProblem::SerialSyntax)?;
    let port = hex
        .chars()
        .filter_map(|c| c.to_digit(16))
        .try_fold(0u16, |acc, d| {
            acc.checked_mul(16)?.checked_add(u16::try_from(d).ok()?)
        })
        .ok_or(ValueProblem::SerialRange)?;
    if (1..=MAX_SERIAL).contains(&port) {
        Ok(port)
    } else {
        Err(ValueProblem::SerialRange)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn err(s: &str) -> CmdlineError<'_> {
        parse(s).unwrap_err()
    }

    #[test]
    fn defaults() {
        let o = parse("").unwrap();
        assert_eq!(o, Options::default());
        assert_eq!(parse(" \t\n ").unwrap(), o);
        assert_eq!(o.period, Period::Nanos(1_000_000));
        assert_eq!(o.export, Export::Stream);
        assert_eq!(o.selftest, SelfTest::None);
        assert_eq!(o.serial, 0x3f8);
        assert_eq!(
            o.to_string(),
            "period=1ms export=stream selftest=none serial=0x3f8 buffer=auto slice=10ms channel=serial stacks=off"
        );
    }

    #[test]
    fn all_options() {
        let o = parse("  period=250us\texport=end selftest=pagefault serial=0x2F8 ").unwrap();
        assert_eq!(
            o,
            Options {
                period: Period::Nanos(250_000),
                export: Export::End,
                selftest: SelfTest::PageFault,
                serial: 0x2f8,
                buffer: 0,
                slice: DEFAULT_SLICE,
                channel: Channel::Serial,
                stacks: 0,
            }
        );
        assert_eq!(parse("stacks=on").unwrap().stacks, DEFAULT_STACK_DEPTH);
        assert_eq!(parse("stacks=off").unwrap().stacks, 0);
        assert_eq!(parse("stacks=32").unwrap().stacks, 32);
        assert_eq!(parse("stacks=1").unwrap().stacks, 1);
        for bad in [
            "stacks=0",
            "stacks=33",
            "stacks=+4",
            "stacks=yes",
            "stacks=-1",
        ] {
            assert!(
                matches!(
                    parse(bad),
                    Err(CmdlineError::BadValue {
                        problem: ValueProblem::StacksChoice,
                        ..
                    })
                ),
                "{bad}"
            );
        }
        assert_eq!(parse("channel=lpt").unwrap().channel, Channel::Lpt);
        assert_eq!(parse("channel=virtio").unwrap().channel, Channel::Virtio);
        assert_eq!(
            parse("selftest=channel").unwrap().selftest,
            SelfTest::Channel(CHANNEL_TEST_RECORDS)
        );
        assert_eq!(
            parse("selftest=channel:5000").unwrap().selftest,
            SelfTest::Channel(5000)
        );
        assert!(parse("selftest=channel:0").is_err());
        assert!(parse("selftest=channel:x").is_err());
        assert_eq!(parse("buffer=100").unwrap().buffer, 100);
        assert_eq!(
            parse("buffer=0").unwrap_err(),
            CmdlineError::BadValue {
                key: "buffer",
                value: "0",
                problem: ValueProblem::BufferSyntax
            }
        );
        assert_eq!(
            o.to_string(),
            "period=250us export=end selftest=pagefault serial=0x2f8 buffer=auto slice=10ms channel=serial stacks=off"
        );
        assert_eq!(
            parse("period=100000ticks").unwrap().period,
            Period::Ticks(100_000)
        );
        assert_eq!(parse("period=7ns").unwrap().period, Period::Nanos(7));
        assert_eq!(parse("period=2000ns").unwrap().period.to_string(), "2us");
        assert_eq!(parse("period=3000us").unwrap().period.to_string(), "3ms");
        assert_eq!(parse("serial=0X3F8").unwrap().serial, 0x3f8);
        for (v, t) in [
            ("none", SelfTest::None),
            ("ud", SelfTest::Ud),
            ("pagefault", SelfTest::PageFault),
            ("gp", SelfTest::Gp),
            ("panic", SelfTest::Panic),
        ] {
            assert_eq!(parse(&format!("selftest={v}")).unwrap().selftest, t);
        }
    }

    #[test]
    fn structural_errors() {
        assert_eq!(
            err("period=1ms bogus"),
            CmdlineError::NotKeyValue { token: "bogus" }
        );
        assert_eq!(
            err("bogus").to_string(),
            "boot option 'bogus' is not of the form key=value"
        );
        assert_eq!(err("bogus=1"), CmdlineError::UnknownKey { key: "bogus" });
        assert_eq!(
            err("bogus=1").to_string(),
            "unknown boot option 'bogus' (known: period, export, selftest, serial, buffer, slice, channel, stacks)"
        );
        assert_eq!(err("=1"), CmdlineError::UnknownKey { key: "" });
        assert_eq!(
            err("Period=1ms"),
            CmdlineError::UnknownKey { key: "Period" }
        );
        assert_eq!(err("export="), CmdlineError::EmptyValue { key: "export" });
        assert_eq!(
            err("export=").to_string(),
            "boot option export= has an empty value"
        );
        assert_eq!(
            err("period=1ms export=end period=2ms"),
            CmdlineError::Repeated { key: "period" }
        );
        assert_eq!(
            err("serial=0x3f8 serial=0x3f8").to_string(),
            "boot option serial is given more than once"
        );
        assert_eq!(
            err("bad\u{1b}=1").to_string(),
            "unknown boot option 'bad\\u{1b}' (known: period, export, selftest, serial, buffer, slice, channel, stacks)"
        );
    }

    #[test]
    fn value_errors() {
        let cases = [
            ("period=5parsecs", ValueProblem::PeriodSyntax),
            ("period=ms", ValueProblem::PeriodSyntax),
            ("period=5", ValueProblem::PeriodSyntax),
            ("period=+5ms", ValueProblem::PeriodSyntax),
            ("period=1.5ms", ValueProblem::PeriodSyntax),
            ("period=5MS", ValueProblem::PeriodSyntax),
            ("period=0ms", ValueProblem::PeriodZero),
            ("period=0ticks", ValueProblem::PeriodZero),
            (
                "period=18446744073709551616ns",
                ValueProblem::PeriodTooLarge,
            ),
            ("period=18446744073710ms", ValueProblem::PeriodTooLarge),
            ("export=later", ValueProblem::ExportChoice),
            ("selftest=df", ValueProblem::SelfTestChoice),
            ("serial=3f8", ValueProblem::SerialSyntax),
            ("serial=0x", ValueProblem::SerialSyntax),
            ("serial=0x3g8", ValueProblem::SerialSyntax),
            ("serial=0x+3f8", ValueProblem::SerialSyntax),
            ("serial=0x0", ValueProblem::SerialRange),
            ("serial=0xfff9", ValueProblem::SerialRange),
            ("serial=0x10000", ValueProblem::SerialRange),
            ("channel=usb", ValueProblem::ChannelChoice),
        ];
        for (s, problem) in cases {
            match parse(s) {
                Err(CmdlineError::BadValue {
                    problem: p, value, ..
                }) => {
                    assert_eq!(p, problem, "{s}");
                    assert_eq!(Some(value), s.split_once('=').map(|(_, v)| v));
                }
                other => panic!("{s}: {other:?}"),
            }
        }
        assert_eq!(parse("serial=0x0000fff8").unwrap().serial, 0xfff8);
        assert_eq!(
            parse("period=18446744073709551615ticks").unwrap().period,
            Period::Ticks(u64::MAX)
        );
        assert_eq!(
            err("period=5parsecs").to_string(),
            "boot option period='5parsecs': expected a number with unit ns, us, ms or ticks \
             (e.g. period=1ms)"
        );
        assert_eq!(
            err("export=later").to_string(),
            "boot option export='later': expected stream or end (where the log goes is \
             channel=serial, lpt or virtio)"
        );
        let _: &dyn core::error::Error = &err("x");
    }

    #[test]
    fn tsc_ticks() {
        assert_eq!(
            Period::Nanos(1_000_000).to_tsc_ticks(3_000_000_000),
            3_000_000
        );
        assert_eq!(Period::Ticks(42).to_tsc_ticks(3_000_000_000), 42);
        assert_eq!(Period::Nanos(1).to_tsc_ticks(1_000), 1);
        assert_eq!(Period::Nanos(u64::MAX).to_tsc_ticks(u64::MAX), u64::MAX);
    }

    fn period() -> impl Strategy<Value = Period> {
        prop_oneof![
            (1..=u64::MAX).prop_map(Period::Nanos),
            (1..=u64::MAX).prop_map(Period::Ticks),
            (1u64..100_000).prop_map(|n| Period::Nanos(n * 1_000)),
            (1u64..100_000).prop_map(|n| Period::Nanos(n * 1_000_000)),
        ]
    }

    fn options() -> impl Strategy<Value = Options> {
        (
            period(),
            prop_oneof![Just(Export::Stream), Just(Export::End)],
            prop_oneof![
                Just(SelfTest::None),
                Just(SelfTest::Ud),
                Just(SelfTest::PageFault),
                Just(SelfTest::Gp),
                Just(SelfTest::Panic),
            ],
            1..=MAX_SERIAL,
            prop_oneof![Just(0u32), 1..=u32::MAX],
            period(),
            prop_oneof![Just(Channel::Serial), Just(Channel::Lpt)],
            0..=MAX_STACK_DEPTH,
        )
            .prop_map(
                |(period, export, selftest, serial, buffer, slice, channel, stacks)| Options {
                    period,
                    export,
                    selftest,
                    serial,
                    buffer,
                    slice,
                    channel,
                    stacks,
                },
            )
    }

    proptest! {
        #[test]
        fn never_panics(s in any::<String>()) {
            if let Err(e) = parse(&s) {
                let _ = e.to_string();
            }
        }

        #[test]
        fn never_panics_on_near_misses(
            s in "((period|export|selftest|serial|x)=?(0x)?[0-9a-fA-Fx]{0,22}(ns|us|ms|ticks|stream|end|ud|gp)?[ \t]?){0,5}"
        ) {
            match parse(&s) {
                Ok(o) => prop_assert_eq!(parse(&o.to_string()).unwrap(), o),
                Err(e) => { let _ = e.to_string(); }
            }
        }

        #[test]
        fn display_round_trips(o in options()) {
            let text = o.to_string();
            prop_assert_eq!(parse(&text).unwrap(), o);
        }

        #[test]
        fn subset_and_order_do_not_matter(o in options(), mask in 0u8..=255, rotate in 0usize..8) {
            let text = o.to_string();
            let mut tokens: Vec<&str> = text.split(' ').collect();
            tokens.rotate_left(rotate);
            let kept: Vec<&str> = tokens
                .iter()
                .copied()
                .filter(|t| {
                    let i = KNOWN_KEYS.iter().position(|k| t.starts_with(k)).unwrap();
                    mask & (1 << i) != 0
                })
                .collect();
            let parsed = parse(&kept.join("  ")).unwrap();
            let d = Options::default();
            prop_assert_eq!(parsed.period, if mask & 1 != 0 { o.period } else { d.period });
            prop_assert_eq!(parsed.export, if mask & 2 != 0 { o.export } else { d.export });
            prop_assert_eq!(parsed.selftest, if mask & 4 != 0 { o.selftest } else { d.selftest });
            prop_assert_eq!(parsed.serial, if mask & 8 != 0 { o.serial } else { d.serial });
            prop_assert_eq!(parsed.buffer, if mask & 16 != 0 { o.buffer } else { d.buffer });
            prop_assert_eq!(parsed.slice, if mask & 32 != 0 { o.slice } else { d.slice });
            prop_assert_eq!(parsed.channel, if mask & 64 != 0 { o.channel } else { d.channel });
            prop_assert_eq!(parsed.stacks, if mask & 128 != 0 { o.stacks } else { d.stacks });
        }
    }
}
