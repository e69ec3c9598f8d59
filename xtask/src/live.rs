//! What `cargo xtask run` and `demo` show while the emulator runs: the console text, and on a
//! terminal one live status line with the sample log's frames, records and losses. The binary
//! frames themselves never reach the terminal (they can hold any byte, control sequences
//! included); the capture file keeps everything.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use hvprof_samplelog::{Item, StreamDecoder};

/// Counts of what arrived so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub frames: u64,
    pub records: u64,
    pub samples: u64,
    /// Blocks missing from each pCPU's numbering so far.
    pub blocks_lost: u64,
    /// The largest ring-drop count any block reported, summed over pCPUs.
    pub dropped: u64,
    pub damaged: u64,
}

/// Splits a live capture into console text (written to `out`) and counted frames.
pub struct LiveEcho<W: Write> {
    decoder: StreamDecoder,
    out: W,
    counts: Counts,
    /// Per pCPU: the next block number expected, and its drop count.
    pcpus: BTreeMap<u16, (u64, u64)>,
    status: Option<Status>,
    /// The last item was a frame (its trailing line break is not shown).
    after_frame: bool,
}

/// `t` without the line break the hypervisor sends after each frame (so that the console stays
/// readable around them), which would show as a blank line where the frame was, when the item
/// before was a frame (`after_frame`, cleared once the break is past). The text may come in
/// pieces: "\r" in one, "\n" in the next.
fn after_break<'t>(mut t: &'t str, after_frame: &mut bool) -> &'t str {
    if *after_frame && let Some(rest) = t.strip_prefix('\r') {
        t = rest;
    }
    if *after_frame && let Some(rest) = t.strip_prefix('\n') {
        t = rest;
        *after_frame = false;
    }
    if !t.is_empty() {
        *after_frame = false;
    }
    t
}

/// The live status line on a terminal (stderr).
struct Status {
    shown: bool,
    last: Instant,
}

impl<W: Write> LiveEcho<W> {
    /// `status`: show the live status line on stderr (only where stderr is a terminal).
    pub fn new(out: W, status: bool) -> Self {
        Self {
            decoder: StreamDecoder::new(),
            out,
            counts: Counts::default(),
            pcpus: BTreeMap::new(),
            after_frame: false,
            status: (status && std::io::stderr().is_terminal()).then(|| Status {
                shown: false,
                last: Instant::now(),
            }),
        }
    }

    /// Takes the next bytes of the capture.
    pub fn feed(&mut self, bytes: &[u8]) {
        let mut text = String::new();
        let counts = &mut self.counts;
        let pcpus = &mut self.pcpus;
        let after_frame = &mut self.after_frame;
        self.decoder.feed(bytes, &mut |item| match item {
            // The line break the hypervisor sends after each frame (so that the console stays
            // readable around them) would show as a blank line where the frame was.
            Item::Text { text: t, .. } => text.push_str(after_break(t, after_frame)),
            Item::Damage(_) => counts.damaged += 1,
            Item::Block {
                header, records, ..
            } => {
                *after_frame = true;
                counts.frames += 1;
                counts.records += records.len() as u64;
                counts.samples += records.iter().filter(|r| r.as_sample().is_some()).count() as u64;
                let entry = pcpus.entry(header.pcpu).or_insert((0, 0));
                counts.blocks_lost += header.seq.saturating_sub(entry.0);
                entry.0 = entry.0.max(header.seq.saturating_add(1));
                if header.ring_drops > entry.1 {
                    counts.dropped += header.ring_drops - entry.1;
                    entry.1 = header.ring_drops;
                }
            }
            _ => {
                *after_frame = true;
                counts.frames += 1;
            }
        });
        self.write_text(&text);
        self.show_status(false);
    }

    /// The end of the capture: the rest of the text, and the final status.
    pub fn finish(&mut self) -> Counts {
        let mut text = String::new();
        let after_frame = &mut self.after_frame;
        self.decoder.finish(&mut |item| {
            if let Item::Text { text: t, .. } = item {
                text.push_str(after_break(t, after_frame));
            }
        });
        self.write_text(&text);
        self.show_status(true);
        if let Some(s) = &self.status
            && s.shown
        {
            eprintln!();
        }
        self.counts.clone()
    }

    fn write_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.clear_status();
        // Console text is the hypervisor's own, with guest output escaped by it; still, nothing
        // that could drive the terminal reaches it.
        let clean: String = text
            .chars()
            .filter(|&c| c == '\n' || c == '\t' || !c.is_control())
            .collect();
        let _ = self.out.write_all(clean.as_bytes());
        let _ = self.out.flush();
    }

    fn clear_status(&mut self) {
        if let Some(s) = &mut self.status
            && s.shown
        {
            eprint!("\r\x1b[K");
            s.shown = false;
        }
    }

    fn show_status(&mut self, force: bool) {
        let line = self.status_line();
        let Some(s) = &mut self.status else {
            return;
        };
        if !force && s.last.elapsed() < Duration::from_millis(250) {
            return;
        }
        s.last = Instant::now();
        eprint!("\r\x1b[K{line}");
        let _ = std::io::stderr().flush();
        s.shown = true;
    }

    fn status_line(&self) -> String {
        let c = &self.counts;
        format!(
            "[sample log: {} frames, {} records ({} samples), {} blocks lost, {} records dropped, {} damaged]",
            c.frames, c.records, c.samples, c.blocks_lost, c.dropped, c.damaged
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::{BlockEncoder, Record, Sample, max_block_frame_len};

    #[test]
    fn frames_are_counted_and_never_echoed() {
        let mut enc = BlockEncoder::new(0, 1000);
        let records = [Record::Sample(Sample {
            tsc: 5,
            ..Sample::default()
        }); 3];
        let mut frame = vec![0u8; max_block_frame_len(3, 0)];
        let mut capture = b"hvprof: ready\r\n".to_vec();
        for _ in 0..2 {
            let n = enc.encode(&records, &[], 0, &mut frame).unwrap();
            capture.extend_from_slice(&frame[..n]);
            // The line break the hypervisor sends after each frame.
            capture.extend_from_slice(b"\r\n");
        }
        // A third block is lost in transit, the fourth reports 7 records dropped.
        let _ = enc.encode(&records, &[], 0, &mut frame).unwrap();
        let n = enc.encode(&records, &[], 7, &mut frame).unwrap();
        capture.extend_from_slice(&frame[..n]);
        capture.extend_from_slice(b"\r\n[vm] done\x1b[2J\r\nhvprof: power off\r\n");
        let mut out = Vec::new();
        let mut live = LiveEcho::new(&mut out, false);
        // Fed in small pieces, as a live capture arrives.
        for chunk in capture.chunks(7) {
            live.feed(chunk);
        }
        let counts = live.finish();
        assert_eq!(counts.frames, 3);
        assert_eq!((counts.records, counts.samples), (9, 9));
        assert_eq!((counts.blocks_lost, counts.dropped), (1, 7));
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("hvprof: ready"), "{text:?}");
        assert!(text.contains("[vm] done[2J"), "escape removed: {text:?}");
        assert!(text.contains("hvprof: power off"), "{text:?}");
        assert!(!text.contains('\0') && !text.contains("HVP"), "{text:?}");
        // No blank line where a frame was.
        assert!(
            !text.contains("\n\n") && !text.contains("\r\n\r\n"),
            "{text:?}"
        );
    }
}
