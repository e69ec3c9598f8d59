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
//! | `selftest` | `none`, `ud`, `pagefault`, `gp`, `panic`         | `none`   |
//! | `serial`   | `0x`-prefixed hexadecimal I/O port, `0x1..=0xfff8` | `0x3f8` |
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
}

impl fmt::Display for SelfTest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Ud => "ud",
            Self::PageFault => "pagefault",
            Self::Gp => "gp",
            Self::Panic => "panic",
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
}

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
        }
    }
}

impl fmt::Display for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "period={} export={} selftest={} serial={:#x}",
            self.period, self.export, self.selftest, self.serial
        )
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
}

impl fmt::Display for ValueProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PeriodSyntax => {
                "expected a number with unit ns, us, ms or ticks (e.g. period=1ms)"
            }
            Self::PeriodZero => "the period must be greater than zero",
            Self::PeriodTooLarge => "the period does not fit in 64 bits of nanoseconds or ticks",
            Self::ExportChoice => "expected stream or end",
            Self::SelfTestChoice => "expected none, ud, pagefault, gp or panic",
            Self::SerialSyntax => "expected a hexadecimal I/O port such as 0x3f8",
            Self::SerialRange => {
                "the port must lie in 0x1..=0xfff8 (a 16550 UART uses 8 consecutive ports)"
            }
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
pub const KNOWN_KEYS: [&str; 4] = ["period", "export", "selftest", "serial"];

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
                "unknown boot option '{}' (known: period, export, selftest, serial)",
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
                    _ => return Err(bad(ValueProblem::SelfTestChoice)),
                }
            }
            _ => options.serial = parse_serial(value).map_err(bad)?,
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
