//! `selftest=channel[:records]`: sends the channel self-test's synthetic record stream
//! (`hvprof_samplelog::channel_test`, which the host makes again to check the capture bit-exact)
//! through the chosen channel, then powers off. It runs before any VMX check, so it measures a
//! channel where there is no VMX (QEMU TCG). pCPU 0's cost frame carries the TSC ticks spent in
//! the channel (`export_ticks`) and the whole test's (`span_ticks`): the host divides the bytes
//! it received by them.

use crate::profiler::export;
use crate::tsc::rdtsc;
use crate::{power, println, virtio_console};
use hvprof_boot::cmdline::Channel;
use hvprof_samplelog::PcpuCost;
use hvprof_samplelog::channel_test::{self, PCPUS, Sink};

/// Sends `records` records of the stream on `channel` (the serial line when `virtio` finds no
/// device) and powers off.
pub fn run(records: u64, channel: Channel, build_id: &[u8], tsc_hz: u64) -> ! {
    let channel = export::open_channel(channel, "selftest");
    println!("selftest: channel {channel}: sending {records} records");
    let mut out = Sender {
        channel,
        start: rdtsc(),
        span: 0,
        ticks: 0,
        bytes: 0,
    };
    channel_test::send(records, &channel_test::header(build_id, tsc_hz), &mut out);
    if channel == Channel::Virtio {
        virtio_console::drain();
    }
    let (_, lost) = virtio_console::counts();
    println!(
        "selftest: channel {channel}: {} bytes in {} TSC ticks in the channel ({} in all){}",
        out.bytes,
        out.ticks,
        out.span,
        if lost > 0 {
            alloc::format!(", {lost} bytes lost")
        } else {
            alloc::string::String::new()
        }
    );
    power::off();
}

/// Sends frames on one channel, counting its bytes and the TSC ticks spent in it.
struct Sender {
    channel: Channel,
    start: u64,
    span: u64,
    ticks: u64,
    bytes: u64,
}

impl Sink for Sender {
    fn frame(&mut self, frame: &[u8]) {
        let t = rdtsc();
        export::put_frame(self.channel, frame);
        self.ticks += rdtsc().wrapping_sub(t);
        self.bytes += frame.len() as u64;
    }

    /// The blocks are out (the virtio console's last buffer too): pCPU 0's cost says how long
    /// they took.
    fn costs(&mut self) -> [PcpuCost; PCPUS as usize] {
        if self.channel == Channel::Virtio {
            let t = rdtsc();
            virtio_console::drain();
            self.ticks += rdtsc().wrapping_sub(t);
        }
        self.span = rdtsc().wrapping_sub(self.start);
        core::array::from_fn(|p| PcpuCost {
            pcpu: p as u16,
            span_ticks: if p == 0 { self.span } else { 0 },
            export_ticks: if p == 0 { self.ticks } else { 0 },
            ..PcpuCost::default()
        })
    }
}
