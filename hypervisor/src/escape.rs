//! Escaping of guest-controlled bytes before they reach the console line.
//!
//! The console carries text and the sample log's binary frames on one line: a frame is
//! `0x00 COBS(payload) 0x00`, and its fifth byte (the frame type, copied verbatim by COBS) is
//! 0x01-0x08. A guest that could put those bytes on the line could forge frames, and one that
//! could put ESC or CR there could rewrite what a terminal shows. So every byte of guest output
//! that is a C0 control (0x00-0x1F), DEL (0x7F), a C1 control (U+0080-U+009F) or not part of
//! valid UTF-8 is written as `\xNN` (and `\` itself as `\\`, so the escaping is unambiguous);
//! printable ASCII and valid non-control UTF-8 pass unchanged.

/// Calls `out` with each byte of `line` escaped.
pub fn escape(line: &[u8], mut out: impl FnMut(u8)) {
    fn hex(b: u8, out: &mut impl FnMut(u8)) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        out(b'\\');
        out(b'x');
        out(DIGITS[usize::from(b >> 4)]);
        out(DIGITS[usize::from(b & 0xf)]);
    }
    let mut rest = line;
    while !rest.is_empty() {
        let (valid, bad) = match core::str::from_utf8(rest) {
            Ok(s) => (s, 0),
            Err(e) => {
                let valid = e.valid_up_to();
                // The first `valid_up_to` bytes are valid UTF-8 by definition.
                let s = core::str::from_utf8(&rest[..valid]).unwrap_or("");
                (s, e.error_len().unwrap_or(rest.len() - valid))
            }
        };
        for c in valid.chars() {
            let code = u32::from(c);
            if code < 0x20 || code == 0x7f || (0x80..0xa0).contains(&code) {
                let mut buf = [0u8; 4];
                for &b in c.encode_utf8(&mut buf).as_bytes() {
                    hex(b, &mut out);
                }
            } else if c == '\\' {
                out(b'\\');
                out(b'\\');
            } else {
                let mut buf = [0u8; 4];
                for &b in c.encode_utf8(&mut buf).as_bytes() {
                    out(b);
                }
            }
        }
        let start = valid.len();
        for &b in &rest[start..start + bad] {
            hex(b, &mut out);
        }
        rest = &rest[start + bad..];
    }
}

/// The length of `line` escaped.
pub fn escaped_len(line: &[u8]) -> usize {
    let mut n = 0;
    escape(line, |_| n += 1);
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn esc(line: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        escape(line, |b| v.push(b));
        assert_eq!(v.len(), escaped_len(line));
        v
    }

    #[test]
    fn printable_text_is_unchanged() {
        assert_eq!(esc(b"hello, world 42 %~"), b"hello, world 42 %~");
        assert_eq!(esc("grüße €".as_bytes()), "grüße €".as_bytes());
    }

    #[test]
    fn controls_and_bad_bytes_are_escaped() {
        assert_eq!(esc(b"a\0b"), b"a\\x00b");
        assert_eq!(esc(b"\x1b[2J"), b"\\x1b[2J");
        assert_eq!(esc(b"\x01HVP\x02"), b"\\x01HVP\\x02");
        assert_eq!(esc(b"x\x7f"), b"x\\x7f");
        assert_eq!(esc(b"\\x00"), b"\\\\x00");
        // U+0085 (NEL), a C1 control, in UTF-8.
        assert_eq!(esc("a\u{85}b".as_bytes()), b"a\\xc2\\x85b");
        // Invalid UTF-8: a lone continuation byte and a truncated sequence.
        assert_eq!(esc(b"a\x80b\xe2\x82"), b"a\\x80b\\xe2\\x82");
    }

    /// A forged frame (NUL delimiters, COBS code bytes, a frame type of 1..=8) cannot survive.
    #[test]
    fn a_forged_frame_loses_its_delimiters_and_type() {
        let mut frame = vec![0u8, 0x30];
        frame.extend_from_slice(b"HVP\x01");
        frame.extend((1u8..=255).collect::<Vec<_>>());
        frame.push(0);
        let out = esc(&frame);
        assert!(!out.contains(&0));
        assert!(out.iter().all(|&b| b >= 0x20 && b != 0x7f), "{out:?}");
        assert!(
            !out.windows(4)
                .any(|w| &w[..3] == b"HVP" && (1..=8).contains(&w[3]))
        );
    }

    proptest! {
        #[test]
        fn output_is_printable_utf8_without_controls(line in proptest::collection::vec(any::<u8>(), 0..300)) {
            let out = esc(&line);
            let s = core::str::from_utf8(&out).expect("valid UTF-8");
            prop_assert!(s.chars().all(|c| !c.is_control()));
        }

        #[test]
        fn valid_text_without_controls_or_backslashes_is_unchanged(s in "[^\\p{Cc}\\\\]{0,100}") {
            prop_assert_eq!(esc(s.as_bytes()), s.as_bytes().to_vec());
        }
    }
}
