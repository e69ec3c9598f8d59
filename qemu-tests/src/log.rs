//! The serial log of one run, and the helpers scenario checks read it with.

/// The text the hypervisor wrote on COM1 during one run.
///
/// Lines are split on `\n` and read as a terminal shows them: terminal escape sequences (firmware
/// and GRUB write them on the same port under UEFI) are removed, and a carriage return inside a
/// line starts it over. Bytes that are not UTF-8 become U+FFFD, so a binary stream later in the
/// log cannot hide the text lines before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SerialLog {
    text: String,
    lines: Vec<String>,
    /// The bytes as captured (the sample log's frames are read from these, never from text).
    raw: Vec<u8>,
}

/// One raw line as a terminal shows it.
fn displayed(raw: &str) -> String {
    let line = raw.trim_end_matches('\r');
    let line = line.rsplit('\r').next().unwrap_or(line);
    crate::process::strip_control(line)
}

impl SerialLog {
    /// Wraps text already read.
    pub fn new(text: impl Into<String>) -> Self {
        let text = text.into();
        let mut lines: Vec<String> = text.split('\n').map(displayed).collect();
        // A final newline does not start another line.
        if text.ends_with('\n') || text.is_empty() {
            lines.pop();
        }
        let raw = text.as_bytes().to_vec();
        Self { text, lines, raw }
    }

    /// Wraps raw bytes as read from the serial log file (or a whole capture).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self {
            raw: bytes.to_vec(),
            ..Self::new(String::from_utf8_lossy(bytes).into_owned())
        }
    }

    /// The bytes as captured.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    /// The whole text, as it came.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The lines, in order, as displayed (see [`SerialLog`]).
    pub fn lines(&self) -> impl Iterator<Item = &str> + '_ {
        self.lines.iter().map(String::as_str)
    }

    /// Whether some line starts with `prefix`.
    pub fn has_line_starting(&self, prefix: &str) -> bool {
        self.find(prefix).is_some()
    }

    /// The first line that starts with `prefix`.
    pub fn find(&self, prefix: &str) -> Option<&str> {
        self.lines().find(|line| line.starts_with(prefix))
    }

    /// Every line that starts with `prefix`, in order.
    pub fn all(&self, prefix: &str) -> Vec<&str> {
        self.lines()
            .filter(|line| line.starts_with(prefix))
            .collect()
    }

    /// The index (0-based, in [`SerialLog::lines`]) of the first line that starts with `prefix`.
    pub fn position(&self, prefix: &str) -> Option<usize> {
        self.lines().position(|line| line.starts_with(prefix))
    }

    /// The first line that starts with `prefix`, or an error naming the missing line.
    pub fn expect(&self, prefix: &str) -> Result<&str, String> {
        self.find(prefix)
            .ok_or_else(|| format!("no line starting with {prefix:?}"))
    }

    /// The first line that starts with `prefix` and contains `needle`, or an error saying which
    /// part was missing.
    pub fn expect_containing(&self, prefix: &str, needle: &str) -> Result<&str, String> {
        let candidates = self.all(prefix);
        if candidates.is_empty() {
            return Err(format!(
                "no line starting with {prefix:?} (wanted one containing {needle:?})"
            ));
        }
        candidates
            .iter()
            .find(|line| line.contains(needle))
            .copied()
            .ok_or_else(|| {
                format!(
                    "no line starting with {prefix:?} contains {needle:?}; saw {:?}",
                    candidates[0]
                )
            })
    }

    /// An error if some line starts with `prefix` (the error quotes that line).
    pub fn expect_none(&self, prefix: &str) -> Result<(), String> {
        match self.find(prefix) {
            None => Ok(()),
            Some(line) => Err(format!("unexpected line {line:?}")),
        }
    }

    /// The first line starting with `then` that comes after the first line starting with `first`.
    pub fn expect_after(&self, first: &str, then: &str) -> Result<&str, String> {
        let start = self
            .position(first)
            .ok_or_else(|| format!("no line starting with {first:?}"))?;
        self.lines()
            .skip(start + 1)
            .find(|line| line.starts_with(then))
            .ok_or_else(|| format!("no line starting with {then:?} after the line {first:?}"))
    }

    /// The lines after the first line that starts with `prefix` (empty if there is none).
    pub fn lines_after(&self, prefix: &str) -> Vec<&str> {
        match self.position(prefix) {
            Some(index) => self.lines().skip(index + 1).collect(),
            None => Vec::new(),
        }
    }

    /// The last `n` lines.
    pub fn tail(&self, n: usize) -> Vec<&str> {
        let lines: Vec<&str> = self.lines().collect();
        lines[lines.len().saturating_sub(n)..].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SerialLog {
        SerialLog::new(
            "hvprof 0.1.0 build-id 00112233\r\n\
             memory: 0x0-0x9fc00 available\r\n\
             memory: usable 511 MiB\r\n\
             module 0: sample.elf ok\r\n\
             hvprof: ready (1 CPUs)\r\n\
             hvprof: power off (acpi)\r\n",
        )
    }

    #[test]
    fn lines_strip_carriage_returns() {
        let log = sample();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 6);
        assert_eq!(lines[0], "hvprof 0.1.0 build-id 00112233");
        assert!(lines.iter().all(|l| !l.contains('\r')));
    }

    #[test]
    fn find_all_and_has() {
        let log = sample();
        assert!(log.has_line_starting("hvprof: ready"));
        assert!(!log.has_line_starting("hvprof: refused"));
        assert_eq!(log.find("memory:"), Some("memory: 0x0-0x9fc00 available"));
        assert_eq!(log.all("memory:").len(), 2);
        assert!(log.all("cpu:").is_empty());
        assert_eq!(log.position("module 0:"), Some(3));
    }

    #[test]
    fn expect_names_what_is_missing() {
        let log = sample();
        assert_eq!(log.expect("hvprof: ready"), Ok("hvprof: ready (1 CPUs)"));
        let err = log.expect("cpu: VMX yes").unwrap_err();
        assert!(err.contains("cpu: VMX yes"), "{err}");
    }

    #[test]
    fn expect_containing_and_none() {
        let log = sample();
        assert!(log.expect_containing("hvprof: power off", "acpi").is_ok());
        let err = log
            .expect_containing("hvprof: power off", "8900")
            .unwrap_err();
        assert!(
            err.contains("8900") && err.contains("power off (acpi)"),
            "{err}"
        );
        let err = log.expect_containing("hvprof: refused", "EPT").unwrap_err();
        assert!(err.contains("no line"), "{err}");
        assert!(log.expect_none("hvprof: refused").is_ok());
        assert!(log.expect_none("hvprof: ready").is_err());
    }

    #[test]
    fn order_helpers() {
        let log = sample();
        assert!(
            log.expect_after("hvprof: ready", "hvprof: power off")
                .is_ok()
        );
        assert!(
            log.expect_after("hvprof: power off", "hvprof: ready")
                .is_err()
        );
        assert_eq!(
            log.lines_after("hvprof: ready"),
            vec!["hvprof: power off (acpi)"]
        );
        assert!(log.lines_after("nothing").is_empty());
        assert_eq!(log.tail(2).len(), 2);
        assert_eq!(log.tail(100).len(), 6);
    }

    #[test]
    fn lines_read_as_a_terminal_shows_them() {
        let log = SerialLog::new(
            "\u{1b}[2J\u{1b}[01;01HBdsDxe: loading\r\n\
             \r\u{1b}[0m\u{1b}[37m  Booting `hvprof'\n\
             \rhvprof 0.1.0 build-id 00\r\n\
             progress 10%\rprogress 100%\r\n\
             last without newline",
        );
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(
            lines,
            vec![
                "BdsDxe: loading",
                "  Booting `hvprof'",
                "hvprof 0.1.0 build-id 00",
                "progress 100%",
                "last without newline",
            ]
        );
        assert!(SerialLog::new("").lines().next().is_none());
        assert_eq!(SerialLog::new("\n").lines().collect::<Vec<_>>(), vec![""]);
    }

    #[test]
    fn invalid_utf8_does_not_hide_text() {
        let mut bytes = b"hvprof: ready (2 CPUs)\n".to_vec();
        bytes.extend_from_slice(&[0xff, 0xfe, 0x00, b'\n']);
        bytes.extend_from_slice(b"hvprof: power off (acpi)\n");
        let log = SerialLog::from_bytes(&bytes);
        assert!(log.has_line_starting("hvprof: ready"));
        assert!(log.has_line_starting("hvprof: power off"));
    }
}
