//! The form in which a name from the log or from a guest image reaches any output: control and
//! bidirectional characters escaped.

use std::borrow::Cow;

/// `s` with every control character (C0, DEL, C1: newline, ESC, ...) and every bidirectional
/// formatting character escaped (`\n`, `\t`, `\r`, `\x1b`, `\u{202e}`): the form in which a name
/// from the log or from a guest image (a VM's name, a guest process's `comm`, a symbol) reaches
/// any output, so that a guest cannot start a line, move the cursor or reorder text in a
/// report. Idempotent (the result holds no such character).
pub fn printable(s: &str) -> Cow<'_, str> {
    let bad = |c: char| {
        c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !s.chars().any(bad) {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => o.push_str("\\n"),
            '\t' => o.push_str("\\t"),
            '\r' => o.push_str("\\r"),
            c if bad(c) && (c as u32) < 0x100 => o.push_str(&format!("\\x{:02x}", c as u32)),
            c if bad(c) => o.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => o.push(c),
        }
    }
    Cow::Owned(o)
}
