//! `record` and `top` on live streams: a file being appended to, a TCP port, a Unix socket,
//! a damaged stream; `top`'s screen on a stream whose shares are known by construction.
//!
//! Every stream here is made in the test (hvprof-samplelog's synthetic captures, or records
//! built by hand) and served from a thread of the test; timeouts are hang guards only.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use hvprof_analyze::live::record::{self, RecordOptions, Recorded, Stop};
use hvprof_analyze::live::source::{Reader, Source};
use hvprof_analyze::live::top;
use hvprof_analyze::live::window::Live;
use hvprof_analyze::model::profile::LoadOptions;
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::Images;
use hvprof_samplelog::synth::{self, Capture, CaptureOptions, FrameKind, Rng, SynthConfig};
use hvprof_samplelog::{
    Event, EventKind, FixedStr, Header, MAX_HEADER_FRAME_LEN, NO_VM, OutReason, Record, Sample,
    SampleKind, StreamDecoder, VmInfo, encode_header,
};

/// Longest any test waits for a stream (a hang guard: the streams end long before).
const HANG_GUARD: Duration = Duration::from_secs(120);

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hvprof-analyze-live");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A synthetic capture of two pCPUs with console text between frames, ending with its end
/// frame.
fn capture() -> Capture {
    synth::capture(
        &SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 6000,
            ..SynthConfig::default()
        },
        &CaptureOptions {
            console_every: 7,
            ..CaptureOptions::default()
        },
    )
}

/// `bytes` cut in pieces of 1 to 3000 bytes (a seeded, fixed cut).
fn pieces(bytes: &[u8], seed: u64) -> Vec<&[u8]> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let n = (rng.range(1..3001) as usize).min(rest.len());
        out.push(&rest[..n]);
        rest = &rest[n..];
    }
    out
}

/// Records `source` into a file; returns the file's bytes and what `record` said.
fn record_from(source: &Source, options: &RecordOptions, name: &str) -> (Vec<u8>, Recorded) {
    let reader = Reader::open(source).unwrap();
    let path = tmp(name);
    let mut file = std::fs::File::create(&path).unwrap();
    let recorded = record::record(
        &reader,
        &mut file,
        options,
        &AtomicBool::new(false),
        &mut |_| {},
    )
    .unwrap();
    drop(file);
    (std::fs::read(&path).unwrap(), recorded)
}

fn total_samples(bytes: &[u8]) -> u64 {
    hvprof_analyze::views::report::from_bytes(
        bytes,
        &Images::default(),
        LoadOptions {
            threads: 2,
            keep_guest: false,
            tables: true,
            report_only: true,
            time: None,
            top_rows: None,
            keep_samples: false,
        },
        &Progress::hidden(),
    )
    .1
    .total_samples
}

/// Serves `bytes` in pieces to the first client of a TCP listener, then closes; returns the
/// source to connect to.
fn serve_tcp(bytes: Vec<u8>, seed: u64) -> Source {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        for p in pieces(&bytes, seed) {
            conn.write_all(p).unwrap();
        }
    });
    Source::parse(&format!("tcp:{addr}"))
}

/// `record` follows a file as a writer appends to it in pieces of random sizes, and stops at
/// the end frame: the recording is the file, byte for byte, and holds every sample.
#[test]
fn record_follows_a_growing_file() {
    let cap = capture();
    let path = tmp("growing.log");
    std::fs::write(&path, b"").unwrap();
    let writer = {
        let (bytes, path) = (cap.bytes.clone(), path.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
            for (i, p) in pieces(&bytes, 7).into_iter().enumerate() {
                f.write_all(p).unwrap();
                f.flush().unwrap();
                if i % 8 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    let source = Source::parse(path.to_str().unwrap());
    assert_eq!(source, Source::File(path.clone()));
    let options = RecordOptions {
        until_end: true,
        idle_timeout: Some(HANG_GUARD),
        ..RecordOptions::default()
    };
    let (recorded, r) = record_from(&source, &options, "growing.rec");
    writer.join().unwrap();
    assert_eq!(r.stop, Stop::EndFrame);
    assert_eq!(recorded.len(), cap.bytes.len());
    assert!(recorded == cap.bytes, "the recording differs from the file");
    assert_eq!(total_samples(&recorded), cap.samples);
    // The live counts agree with the capture.
    let t = r.status.totals;
    assert_eq!(t.bytes, cap.bytes.len() as u64);
    assert_eq!(t.samples, cap.samples);
    assert_eq!(t.frames, cap.frames.len() as u64);
    assert_eq!((t.blocks_lost, t.samples_lost, t.damaged), (0, 0, 0));
    assert!(t.end_seen && r.decoded.is_complete());
    // The console text was recorded too.
    assert_eq!(
        r.decoded.text_joined(),
        cap.text
            .iter()
            .map(|t| std::str::from_utf8(&cap.bytes[t.clone()]).unwrap())
            .collect::<String>()
    );
}

/// `record` from a TCP port (QEMU `-chardev socket,host=...,port=...,server=on`): byte for
/// byte, until the connection closes.
#[test]
fn record_reads_a_tcp_port() {
    let cap = capture();
    let source = serve_tcp(cap.bytes.clone(), 11);
    let (recorded, r) = record_from(&source, &RecordOptions::default(), "tcp.rec");
    assert_eq!(r.stop, Stop::SourceEnded);
    assert!(
        recorded == cap.bytes,
        "the recording differs from what was sent"
    );
    assert_eq!(total_samples(&recorded), cap.samples);
}

/// `record` from a Unix socket (QEMU `-chardev socket,path=...,server=on`): byte for byte.
#[test]
fn record_reads_a_unix_socket() {
    let cap = capture();
    let sock = tmp("hvprof.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).unwrap();
    let bytes = cap.bytes.clone();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        for p in pieces(&bytes, 13) {
            conn.write_all(p).unwrap();
        }
    });
    let source = Source::parse(&format!("unix:{}", sock.display()));
    assert_eq!(source, Source::Unix(sock.clone()));
    let (recorded, r) = record_from(&source, &RecordOptions::default(), "unix.rec");
    server.join().unwrap();
    assert_eq!(r.stop, Stop::SourceEnded);
    assert!(
        recorded == cap.bytes,
        "the recording differs from what was sent"
    );
    assert_eq!(total_samples(&recorded), cap.samples);
}

/// A stream damaged on the way (byte ranges dropped, bytes flipped): `record` writes what it
/// received, byte for byte, and the recording's losses are exactly the blocks the damage
/// touched; every other block is there, whole.
#[test]
fn record_of_a_damaged_stream_counts_exactly_what_was_lost() {
    let cap = capture();
    let blocks: Vec<usize> = (0..cap.frames.len())
        .filter(|&i| matches!(cap.frames[i].kind, FrameKind::Block { .. }))
        .collect();
    assert!(blocks.len() > 100);
    let frame = |k: usize| cap.frames[blocks[k]].range.clone();
    // Byte ranges dropped: inside one block; from inside one block to inside the block two
    // frames later (the one between gone whole, with any console text); a single byte.
    let mid = |k: usize| {
        let r = frame(k);
        r.start + r.len() / 2
    };
    let dropped = [
        frame(10).start + 20..frame(10).start + 40,
        mid(40)..mid(42),
        mid(70)..mid(70) + 1,
    ];
    // Bytes flipped.
    let flipped = [mid(25), mid(55), frame(90).start + 9];
    let mut damaged = Vec::with_capacity(cap.bytes.len());
    for (i, &b) in cap.bytes.iter().enumerate() {
        if dropped.iter().any(|r| r.contains(&i)) {
            continue;
        }
        damaged.push(if flipped.contains(&i) { b ^ 0x5a } else { b });
    }
    let touched: Vec<usize> = (0..cap.frames.len())
        .filter(|&f| {
            let r = &cap.frames[f].range;
            dropped.iter().any(|d| d.start < r.end && r.start < d.end)
                || flipped.iter().any(|&i| r.contains(&i))
        })
        .collect();
    // Blocks 10, 25, 40, 41, 42, 55, 70, 90.
    assert_eq!(touched.len(), 8);
    let (mut samples, mut events) = (0u64, 0u64);
    for &f in &touched {
        let FrameKind::Block {
            samples: s,
            events: e,
            ..
        } = cap.frames[f].kind
        else {
            panic!("frame {f} is not a block");
        };
        samples += s;
        events += e;
    }

    let source = serve_tcp(damaged.clone(), 17);
    let (recorded, r) = record_from(&source, &RecordOptions::default(), "damaged.rec");
    assert!(recorded == damaged, "record changed what it received");

    let d = hvprof_samplelog::decode(&recorded);
    assert!(d.end_seen());
    assert_eq!(d.blocks_lost(), touched.len() as u64);
    assert_eq!(d.samples_lost(), samples);
    assert_eq!(d.events_lost(), events);
    assert!(d.damaged.len() >= dropped.len() + flipped.len() - 1);
    assert_eq!(d.header.as_ref(), Some(&cap.header));
    // Every block the damage did not touch is there, whole, in order.
    for (&pcpu, log) in &d.pcpus {
        let want: Vec<Record> = (0..cap.frames.len())
            .filter(|f| !touched.contains(f))
            .filter(|&f| matches!(&cap.frames[f].kind, FrameKind::Block { header, .. } if header.pcpu == pcpu))
            .flat_map(|f| cap.frames[f].records.iter().copied())
            .collect();
        assert_eq!(log.records, want, "pCPU {pcpu}");
        assert_eq!(log.inconsistent_blocks, 0);
    }
    // What `record` counted as the bytes came, and the description it kept, say the same.
    let t = r.status.totals;
    assert_eq!(t.blocks_lost, d.blocks_lost());
    assert_eq!(t.samples_lost, d.samples_lost());
    assert_eq!(t.events_lost, d.events_lost());
    assert_eq!(t.damaged, d.damaged.len() as u64);
    assert_eq!(t.frames, d.frames);
    assert_eq!(t.samples, cap.samples - samples);
    assert_eq!(r.decoded.blocks_lost(), d.blocks_lost());
    assert_eq!(r.decoded.damaged, d.damaged);
    // The rest is intact: the profile has every sample but the lost ones.
    assert_eq!(total_samples(&recorded), cap.samples - samples);
}

/// The clock of the handmade stream: 1 MHz, so one second is 1,000,000 ticks.
const HZ: u64 = 1_000_000;
const SECOND: u64 = HZ;

/// A stream whose shares are known: 1000 samples every 10 ms from 5 s to 15 s of host time on
/// pCPU 0 — VM `a` 600 (function 0x1000: 450, 0x2000: 150), VM `b` 200 (0x3000), the
/// hypervisor 100 (0xffff800000001000), idle 100 — and on pCPU 1 the vCPUs' events: `a`'s
/// vCPU 0 runs throughout; `b`'s vCPU 0 is out halted from 7 s to 10 s (30 % of the window),
/// preempted from 12 s to 13 s (10 %). The last record is at 15 s - 1 tick, so the window
/// (10 s) spans 5 s .. 15 s.
fn known_stream() -> Vec<u8> {
    let mut header = Header {
        tsc_hz: HZ,
        pcpus: 2,
        period_ticks: 10_000,
        ..Header::default()
    };
    for (id, name) in [(0u16, "a"), (1, "b")] {
        header
            .vms
            .push(VmInfo {
                id,
                name: FixedStr::try_from_str(name).unwrap(),
                vcpus: 1,
                image: FixedStr::try_from_str(&format!("{name}.elf")).unwrap(),
                image_build_id: hvprof_samplelog::BuildId::NONE,
            })
            .unwrap();
    }
    let mut out = vec![0u8; MAX_HEADER_FRAME_LEN];
    let n = encode_header(&header, &mut out).unwrap();
    out.truncate(n);
    let guest = |vm: u16, rip: u64| Sample {
        kind: SampleKind::Guest,
        vm,
        vcpu: 0,
        guest_rip: rip,
        guest_cr3: 0x10_0000,
        ..Sample::default()
    };
    let samples: Vec<Record> = (0..1000u64)
        .map(|i| {
            let s = match i % 20 {
                0..9 => guest(0, 0x1000),
                9..12 => guest(0, 0x2000),
                12..16 => guest(1, 0x3000),
                16 | 17 => Sample {
                    kind: SampleKind::Hypervisor,
                    vm: 0,
                    vcpu: 0,
                    host_rip: 0xffff_8000_0000_1000,
                    ..Sample::default()
                },
                _ => Sample {
                    kind: SampleKind::Idle,
                    vm: NO_VM,
                    host_rip: 0xffff_8000_0000_2000,
                    ..Sample::default()
                },
            };
            Record::Sample(Sample {
                tsc: 5 * SECOND + i * 10_000,
                ..s
            })
        })
        .collect();
    let event = |tsc: u64, vm: u16, kind: EventKind, reason: OutReason| {
        Record::Event(Event {
            tsc,
            kind,
            vm,
            vcpu: 0,
            reason,
        })
    };
    let events = vec![
        event(5 * SECOND, 0, EventKind::VcpuIn, OutReason::Preempted),
        event(5 * SECOND, 1, EventKind::VcpuIn, OutReason::Preempted),
        event(7 * SECOND, 1, EventKind::VcpuOut, OutReason::Halted),
        event(10 * SECOND, 1, EventKind::VcpuIn, OutReason::Preempted),
        event(12 * SECOND, 1, EventKind::VcpuOut, OutReason::Preempted),
        event(13 * SECOND, 1, EventKind::VcpuIn, OutReason::Preempted),
        event(15 * SECOND - 1, 0, EventKind::VcpuIn, OutReason::Preempted),
    ];
    out.extend(synth::encode_blocks(0, &samples, 10_000, 64));
    out.extend(synth::encode_blocks(1, &events, 10_000, 64));
    out
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

/// The line holding every one of `parts`, in this order.
fn line_with<'a>(lines: &[&'a str], parts: &[&str]) -> &'a str {
    lines
        .iter()
        .find(|l| {
            let mut rest = **l;
            parts.iter().all(|p| match rest.find(p) {
                Some(i) => {
                    rest = &rest[i + p.len()..];
                    true
                }
                None => false,
            })
        })
        .copied()
        .unwrap_or_else(|| panic!("no line with {parts:?} in\n{}", lines.join("\n")))
}

/// `top`'s screen, rendered into ratatui's test backend, shows the shares the stream was made
/// with: the host level, each VM's functions, the vCPUs' idle and steal.
#[test]
fn top_shows_the_known_shares() {
    let mut live = Live::new(10);
    let mut dec = StreamDecoder::new();
    let bytes = known_stream();
    live.add_bytes(bytes.len() as u64);
    dec.feed(&bytes, &mut |item| live.push(item));
    let images = Images::default();
    let namer = live.namer(&images, &mut Vec::new());
    let s = live.snapshot(&namer, 20);
    assert_eq!(s.samples, 1000);
    assert!((s.span - 10.0).abs() < 1e-5, "span {}", s.span);

    let mut term = ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
    term.draw(|f| top::draw(f, &s, "known")).unwrap();
    let text = top::buffer_text(term.backend().buffer());
    let l = lines(&text);
    // The host level.
    line_with(
        &l,
        &["host: VMs", "80.0%", "hypervisor", "10.0%", "idle", "10.0%"],
    );
    line_with(&l, &["1,000 samples in the window"]);
    line_with(&l, &["60.0%", "600", "[a]", "(vm 0)"]);
    line_with(&l, &["20.0%", "200", "[b]", "(vm 1)"]);
    line_with(
        &l,
        &["10.0%", "100", "[unknown] 0xffff800000001000", "hvprof"],
    );
    line_with(&l, &["10.0%", "100", "[idle]", "(idle)"]);
    // Each VM's functions: a VM's share of the window, a function's of its VM.
    line_with(&l, &["60.0%", "600", "[a] (vm 0)"]);
    line_with(&l, &["75.0%", "450", "[unknown] 0x1000", "a.elf"]);
    line_with(&l, &["25.0%", "150", "[unknown] 0x2000", "a.elf"]);
    line_with(&l, &["20.0%", "200", "[b] (vm 1)"]);
    line_with(&l, &["100.0%", "200", "[unknown] 0x3000", "b.elf"]);
    // The vCPUs: running, idle (out halted), steal (out runnable).
    line_with(&l, &["a", "0", "100.0%", "0.0%", "0.0%"]);
    line_with(&l, &["b", "0", "60.0%", "30.0%", "10.0%"]);
    line_with(&l, &["lost 0 blocks, 0 samples"]);
}

/// `top --batch` on a TCP stream prints the screen when the stream ends.
#[test]
fn top_in_batch_mode_prints_the_last_screen() {
    let source = serve_tcp(known_stream(), 19);
    let reader = Reader::open(&source).unwrap();
    let mut out = Vec::new();
    top::run(
        &reader,
        &Images::default(),
        &top::TopOptions {
            window: 10,
            title: source.to_string(),
            batch: Some((120, 40)),
            idle_timeout: Some(HANG_GUARD),
            call_graph: false,
        },
        &AtomicBool::new(false),
        &mut out,
    )
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    let last = text.rsplit("hvprof top:").next().unwrap();
    assert!(
        last.starts_with(&format!(" {source} (the source ended)")),
        "{last}"
    );
    let l = lines(last);
    line_with(&l, &["60.0%", "600", "[a]", "(vm 0)"]);
    line_with(&l, &["b", "0", "60.0%", "30.0%", "10.0%"]);
}

/// A replay hands over the capture whole, byte for byte.
#[test]
fn a_replay_gives_the_capture_back() {
    let cap = capture();
    let path = tmp("replayed.log");
    std::fs::write(&path, &cap.bytes).unwrap();
    // 12 s of host time at 1000 times the speed.
    let reader = Reader::replay(&path, 1000.0).unwrap();
    let mut got = Vec::new();
    loop {
        match reader.recv_timeout(HANG_GUARD) {
            Some(hvprof_analyze::live::source::Chunk::Data(d)) => got.extend(d),
            Some(hvprof_analyze::live::source::Chunk::End) => break,
            other => panic!("{other:?}"),
        }
    }
    assert!(got == cap.bytes);
}
