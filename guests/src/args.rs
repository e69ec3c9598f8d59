//! The guest's arguments: the module command line as the hypervisor passed it, whitespace-
//! separated words of which the `key=value` ones are looked up here (other words, such as an
//! image name, are ignored). When a key is given twice the last one wins.

use core::fmt;

/// The value of `key=value` in `args`, or `None` when the key is absent.
pub fn arg<'a>(args: &'a str, key: &str) -> Option<&'a str> {
    args.split_ascii_whitespace()
        .filter_map(|word| word.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .next_back()
}

/// Parses an unsigned number: decimal, or hexadecimal with `0x`; `_` separators are allowed.
pub fn parse_u64(s: &str) -> Option<u64> {
    let (digits, radix) = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => (hex, 16),
        None => (s, 10),
    };
    let mut value: u64 = 0;
    let mut any = false;
    for c in digits.chars() {
        if c == '_' {
            continue;
        }
        let d = c.to_digit(radix)?;
        value = value.checked_mul(radix as u64)?.checked_add(d as u64)?;
        any = true;
    }
    any.then_some(value)
}

/// A `key=value` whose value is not what the guest expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadArg<'a> {
    pub key: &'a str,
    pub value: &'a str,
    pub expected: &'static str,
}

impl fmt::Display for BadArg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "bad argument {}={}: expected {}",
            self.key, self.value, self.expected
        )
    }
}

/// The number given as `key=N` (see [`parse_u64`]), `default` when the key is absent, or an
/// error when the value is not a number.
pub fn arg_num<'a>(args: &'a str, key: &'a str, default: u64) -> Result<u64, BadArg<'a>> {
    match arg(args, key) {
        None => Ok(default),
        Some(value) => parse_u64(value).ok_or(BadArg {
            key,
            value,
            expected: "a number (decimal or 0x hex)",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARGS: &str = "vm=a1 mem=8M attack=write target=vm:hello addr=0x1000000";

    #[test]
    fn finds_values() {
        assert_eq!(arg(ARGS, "vm"), Some("a1"));
        assert_eq!(arg(ARGS, "attack"), Some("write"));
        assert_eq!(arg(ARGS, "target"), Some("vm:hello"));
        assert_eq!(arg(ARGS, "addr"), Some("0x1000000"));
        assert_eq!(arg(ARGS, "code"), None);
    }

    #[test]
    fn keys_match_whole_words() {
        assert_eq!(arg("vmx=1 xvm=2", "vm"), None);
        assert_eq!(arg("vm=a", "v"), None);
        assert_eq!(arg("", "vm"), None);
    }

    #[test]
    fn ignores_words_without_equals_and_extra_whitespace() {
        let args = "  hello.elf\tvm=h \n code=7  ";
        assert_eq!(arg(args, "vm"), Some("h"));
        assert_eq!(arg(args, "code"), Some("7"));
        assert_eq!(arg(args, "hello.elf"), None);
    }

    #[test]
    fn empty_value_and_value_with_equals() {
        assert_eq!(arg("vm= code=1", "vm"), Some(""));
        assert_eq!(arg("k=a=b", "k"), Some("a=b"));
    }

    #[test]
    fn last_occurrence_wins() {
        assert_eq!(arg("code=1 code=2", "code"), Some("2"));
    }

    #[test]
    fn parses_numbers() {
        assert_eq!(parse_u64("0"), Some(0));
        assert_eq!(parse_u64("42"), Some(42));
        assert_eq!(parse_u64("0x2e8"), Some(0x2e8));
        assert_eq!(parse_u64("0XFEE00000"), Some(0xfee0_0000));
        assert_eq!(parse_u64("0x100_0000_0000"), Some(1 << 40));
        assert_eq!(parse_u64("18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_u64("18446744073709551616"), None);
        assert_eq!(parse_u64("0x1_0000_0000_0000_0000"), None);
        assert_eq!(parse_u64(""), None);
        assert_eq!(parse_u64("0x"), None);
        assert_eq!(parse_u64("_"), None);
        assert_eq!(parse_u64("-1"), None);
        assert_eq!(parse_u64("12a"), None);
        assert_eq!(parse_u64("0x12g"), None);
    }

    #[test]
    fn numeric_arguments() {
        assert_eq!(arg_num("cpuid=10 io=0x10", "cpuid", 0), Ok(10));
        assert_eq!(arg_num("cpuid=10 io=0x10", "io", 0), Ok(16));
        assert_eq!(arg_num("cpuid=10", "vmcall", 3), Ok(3));
        let err = arg_num("code=x", "code", 42).unwrap_err();
        assert_eq!(err.key, "code");
        assert_eq!(err.value, "x");
        assert_eq!(
            err.to_string(),
            "bad argument code=x: expected a number (decimal or 0x hex)"
        );
    }
}
