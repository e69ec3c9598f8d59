//! The export channels' self-test (`selftest=channel[:records]`, issue 15): the hypervisor sends
//! `hvprof_samplelog::channel_test`'s synthetic stream through one channel before any VMX check,
//! so it runs in QEMU TCG (BIOS and UEFI). The check makes the same frames again on the host and
//! finds every one of them in the capture, byte for byte and in order, and the decoded records
//! equal to the stream's; pCPU 0's cost frame gives the TSC ticks the sender spent in the
//! channel, from which the benchmark reports each channel's bytes per second.

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::runner::Scenario;
use hvprof_samplelog::channel_test::{self, PCPUS, Sink};
use hvprof_samplelog::{PcpuCost, Record};

/// Records the virtio runs send (about 7.7 MB).
pub const VIRTIO_RECORDS: u64 = 1_000_000;
/// Records the UART run sends (about 0.8 MB: the UART is the slow one).
pub const SERIAL_RECORDS: u64 = 100_000;

/// What a channel self-test's capture shows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChannelRun {
    /// Bytes of the stream's frames.
    pub bytes: u64,
    /// TSC ticks the sender spent in the channel, and its TSC rate.
    pub ticks: u64,
    pub tsc_hz: u64,
}

impl ChannelRun {
    /// Bytes per second through the channel.
    pub fn bytes_per_second(&self) -> f64 {
        self.bytes as f64 * self.tsc_hz as f64 / self.ticks.max(1) as f64
    }
}

/// The host's copy of the stream: its frames, with the capture's cost frames.
struct Copy {
    frames: Vec<Vec<u8>>,
    costs: [PcpuCost; PCPUS as usize],
}

impl Sink for Copy {
    fn frame(&mut self, frame: &[u8]) {
        self.frames.push(frame.to_vec());
    }

    fn costs(&mut self) -> [PcpuCost; PCPUS as usize] {
        self.costs
    }
}

/// Checks the console of a channel self-test: `records` records sent on `channel` (not a
/// fallback to another channel).
pub fn check_channel_console(log: &SerialLog, channel: &str, records: u64) -> Result<(), String> {
    let sending = format!("selftest: channel {channel}: sending {records} records");
    if log.has_line_starting(&sending) {
        Ok(())
    } else {
        Err(format!(
            "no line \"{sending}\" (the channel was not found, or the test did not start)"
        ))
    }
}

/// Checks a channel self-test's whole capture (the serial, parallel-port and virtio logs):
/// every frame of the stream found byte for byte and in order, the records decoded equal to the
/// stream's, no loss; returns the bytes and the sender's ticks in the channel.
pub fn check_channel_capture(raw: &[u8], records: u64) -> Result<ChannelRun, String> {
    let decoded = hvprof_samplelog::decode(raw);
    let header = decoded
        .header
        .clone()
        .ok_or("the capture has no header frame")?;
    if !decoded.end_seen() {
        return Err("the capture has no end frame".into());
    }
    if decoded.blocks_lost() + decoded.samples_lost() + decoded.events_lost() > 0 {
        return Err(format!(
            "records lost: {} blocks, {} samples, {} events",
            decoded.blocks_lost(),
            decoded.samples_lost(),
            decoded.events_lost()
        ));
    }
    let mut costs = [PcpuCost::default(); PCPUS as usize];
    for c in &decoded.costs {
        if let Some(slot) = costs.get_mut(usize::from(c.pcpu)) {
            *slot = *c;
        }
    }
    let mut copy = Copy {
        frames: Vec::new(),
        costs,
    };
    channel_test::send(records, &header, &mut copy);
    // Every frame, byte for byte, in order.
    let mut at = 0usize;
    for (i, frame) in copy.frames.iter().enumerate() {
        match raw[at..]
            .windows(frame.len())
            .position(|w| w == frame.as_slice())
        {
            Some(k) => at += k + frame.len(),
            None => {
                return Err(format!(
                    "frame {i} of {} ({} bytes) is not in the capture after byte {at}",
                    copy.frames.len(),
                    frame.len()
                ));
            }
        }
    }
    for p in 0..PCPUS {
        let want: Vec<Record> = (0..channel_test::records_of(records, p))
            .map(|i| channel_test::record(p, i))
            .collect();
        let got = decoded
            .pcpus
            .get(&p)
            .map_or(&[][..], |l| l.records.as_slice());
        if got != want.as_slice() {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            return Err(format!(
                "pCPU {p}: {} records decoded, {} sent; first difference at {first:?}",
                got.len(),
                want.len()
            ));
        }
    }
    let ticks = costs[0].export_ticks;
    if ticks == 0 {
        return Err("pCPU 0's cost frame gives no ticks in the channel".into());
    }
    Ok(ChannelRun {
        bytes: copy.frames.iter().map(|f| f.len() as u64).sum(),
        ticks,
        tsc_hz: header.tsc_hz,
    })
}

fn scenario(name: &str, emulator: Emulator, channel: &'static str, records: u64) -> Scenario {
    Scenario::new(name, emulator)
        .cmdline(&format!("selftest=channel:{records} channel={channel}"))
        .check(move |log| check_channel_console(log, channel, records))
        .profile(move |run| check_channel_capture(&run.capture, records).map(|_| ()))
}

/// The channel self-test scenarios: virtio under SeaBIOS and OVMF, the UART under SeaBIOS.
pub fn all() -> Vec<Scenario> {
    vec![
        scenario(
            "qemu-tcg-virtio-selftest",
            Emulator::QemuTcgBios,
            "virtio",
            VIRTIO_RECORDS,
        ),
        scenario(
            "qemu-uefi-virtio-selftest",
            Emulator::QemuTcgUefi,
            "virtio",
            VIRTIO_RECORDS,
        ),
        scenario(
            "qemu-tcg-serial-selftest",
            Emulator::QemuTcgBios,
            "serial",
            SERIAL_RECORDS,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stream as the hypervisor sends it on the UART: frames, line breaks, console text.
    fn capture(records: u64) -> Vec<u8> {
        struct Out(Vec<u8>);
        impl Sink for Out {
            fn frame(&mut self, frame: &[u8]) {
                self.0.extend_from_slice(frame);
                self.0.extend_from_slice(b"\r\n");
            }
            fn costs(&mut self) -> [PcpuCost; PCPUS as usize] {
                core::array::from_fn(|p| PcpuCost {
                    pcpu: p as u16,
                    export_ticks: if p == 0 { 5_000 } else { 0 },
                    ..PcpuCost::default()
                })
            }
        }
        let mut out = Out(b"selftest: channel serial: sending\r\n".to_vec());
        channel_test::send(
            records,
            &channel_test::header(&[1, 2, 3], 1_000_000),
            &mut out,
        );
        out.0
    }

    #[test]
    fn a_whole_stream_passes_with_its_figures() {
        let raw = capture(1000);
        let run = check_channel_capture(&raw, 1000).unwrap();
        assert_eq!(run.ticks, 5_000);
        assert_eq!(run.tsc_hz, 1_000_000);
        // Frames only: the capture less its line breaks and the first line.
        let frames = raw.len() as u64 - 35 - 2 * (1 + 1000u64.div_ceil(64) + 4 + 1);
        assert!(
            run.bytes <= frames && run.bytes + 8 >= frames,
            "{} {frames}",
            run.bytes
        );
    }

    #[test]
    fn a_damaged_or_short_stream_fails() {
        let raw = capture(1000);
        // A flipped byte in the middle of a block.
        let mut bad = raw.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x40;
        assert!(check_channel_capture(&bad, 1000).is_err());
        // Fewer records than the test sent.
        assert!(check_channel_capture(&capture(999), 1000).is_err());
        // More.
        assert!(check_channel_capture(&capture(1001), 1000).is_err());
        // No end frame.
        let cut = &raw[..raw.len() - 40];
        assert!(check_channel_capture(cut, 1000).is_err());
    }
}
