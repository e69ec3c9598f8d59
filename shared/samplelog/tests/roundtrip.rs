//! Round trips: whatever the encoder accepts, the decoder gives back identically.

use hvprof_samplelog::synth::{self, CaptureOptions, SynthConfig};
use hvprof_samplelog::{
    BlockEncoder, BlockHeader, BuildId, Event, EventKind, FixedStr, Header, Item,
    MAX_BLOCK_RECORDS, MAX_HEADER_FRAME_LEN, MAX_TASK_FRAME_LEN, MAX_VMS, OutReason, PcpuTotals,
    Record, Sample, SampleKind, StreamDecoder, Task, VmInfo, decode, decode_parallel, encode_block,
    encode_end, encode_header, encode_task, max_block_frame_len, max_end_frame_len,
};
use hvprof_samplelog::{Chain, ChainEnd, MAX_CHAIN_DEPTH, chain_frames};
use hvprof_samplelog::{
    EXIT_PORTS, EXIT_REASONS, ExitStats, HISTOGRAM_BUCKETS, MAX_PCPU_COST_FRAME_LEN,
    MAX_SPIN_SITES, MAX_VM_END_FRAME_LEN, MAX_VPMU_VCPUS, PauseLoop, PcpuCost, ReasonStats,
    SpinSite, TaskOffsets, VmEnd, VpmuCounts, VpmuEnd, encode_pcpu_cost, encode_vm_end,
};
use hvprof_samplelog::{MAX_MAPPING_FRAME_LEN, Mapping, MappingKind, encode_mapping};
use hvprof_samplelog::{
    MAX_OUTPUT_CHUNK, MAX_OUTPUT_FRAME_LEN, Output, OutputStream, encode_output,
};
use proptest::prelude::*;

/// Values that repeat (so the delta coder's "unchanged" and history paths run), extremes, and
/// anything.
fn u64_field() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => (0usize..4).prop_map(|i| [0, 0x1234_5000, 0xffff_ffff_8100_0000, 0x5555_5555_4000][i]),
        1 => Just(u64::MAX),
        1 => Just(1u64 << 63),
        2 => any::<u64>(),
        2 => (0u64..1 << 20).prop_map(|d| 0xffff_ffff_8100_0000 + d),
    ]
}

fn u16_field() -> impl Strategy<Value = u16> {
    prop_oneof![3 => 0u16..4, 1 => Just(u16::MAX), 1 => any::<u16>()]
}

fn kind() -> impl Strategy<Value = SampleKind> {
    prop_oneof![
        Just(SampleKind::Guest),
        Just(SampleKind::Hypervisor),
        Just(SampleKind::Idle)
    ]
}

fn sample() -> impl Strategy<Value = Sample> {
    (
        (u64_field(), kind(), u16_field(), u16_field(), u16_field()),
        (
            u64_field(),
            u64_field(),
            any::<u8>(),
            u16_field(),
            u64_field(),
        ),
        prop_oneof![2 => 1000u32..1100, 1 => any::<u32>(), 1 => Just(u32::MAX), 1 => Just(0u32)],
    )
        .prop_map(
            |(
                (tsc, kind, vm, vcpu, vpid),
                (guest_rip, guest_cr3, guest_mode, exit_reason, host_rip),
                cost,
            )| Sample {
                tsc,
                kind,
                vm,
                vcpu,
                vpid,
                guest_rip,
                guest_cr3,
                guest_mode,
                exit_reason,
                host_rip,
                cost,
                ..Sample::default()
            },
        )
}

/// One call chain: not walked, or built from a few shared outer parts (so the coder's "same",
/// shared-suffix and reference paths run) with new inner frames, or anything.
fn chain() -> impl Strategy<Value = (Chain, Vec<u64>)> {
    let ends = (0u8..4).prop_map(ChainEnd::from_u8);
    prop_oneof![
        2 => Just((Chain::NOT_WALKED, Vec::new())),
        4 => (0usize..3, 0usize..12, prop::collection::vec(u64_field(), 0..4), ends.clone())
            .prop_map(|(base, keep, inner, end)| {
                let bases: [&[u64]; 3] = [
                    &[0x40_1234, 0x40_2000, 0x40_3000, 0x40_0100],
                    &[0xffff_ffff_8100_1000, 0xffff_ffff_8100_0200, 0x40_0100],
                    &[7, 6, 5, 4, 3, 2, 1, 0x40_0100, 9, 10, 11, 12],
                ];
                let b = bases[base];
                let mut frames = inner;
                frames.extend_from_slice(&b[b.len() - keep.min(b.len())..]);
                frames.truncate(MAX_CHAIN_DEPTH);
                (Chain::new(frames.len(), end), frames)
            }),
        1 => (prop::collection::vec(any::<u64>(), 0..=MAX_CHAIN_DEPTH), ends)
            .prop_map(|(frames, end)| (Chain::new(frames.len(), end), frames)),
    ]
}

/// `records(max)` with call chains on the samples: the records and their frame list.
fn chained_records(max: usize) -> impl Strategy<Value = (Vec<Record>, Vec<u64>)> {
    (records(max), prop::collection::vec((chain(), chain()), max)).prop_map(|(mut recs, chains)| {
        let mut frames = Vec::new();
        for (r, ((hc, hf), (gc, gf))) in recs.iter_mut().zip(chains) {
            if let Record::Sample(s) = r {
                s.host_chain = hc;
                s.guest_chain = gc;
                frames.extend(hf);
                frames.extend(gf);
            }
        }
        (recs, frames)
    })
}

fn event() -> impl Strategy<Value = Event> {
    (
        u64_field(),
        prop_oneof![Just(EventKind::VcpuIn), Just(EventKind::VcpuOut)],
        u16_field(),
        u16_field(),
        (0u8..4).prop_map(|r| OutReason::from_u8(r).unwrap()),
    )
        .prop_map(|(tsc, kind, vm, vcpu, reason)| Event {
            tsc,
            kind,
            vm,
            vcpu,
            reason,
        })
}

fn record() -> impl Strategy<Value = Record> {
    prop_oneof![4 => sample().prop_map(Record::Sample), 1 => event().prop_map(Record::Event)]
}

/// Records whose TSCs mostly advance by about `period` (the realistic path), sometimes not.
fn records(max: usize) -> impl Strategy<Value = Vec<Record>> {
    (
        prop::collection::vec((record(), any::<bool>(), -5000i64..5000), 0..max),
        any::<u64>(),
    )
        .prop_map(|(v, start)| {
            let mut tsc = start;
            v.into_iter()
                .map(|(mut r, realistic, jitter)| {
                    if realistic {
                        tsc = tsc.wrapping_add(1_000_000).wrapping_add(jitter as u64);
                        match &mut r {
                            Record::Sample(s) => s.tsc = tsc,
                            Record::Event(e) => e.tsc = tsc,
                        }
                    }
                    r
                })
                .collect()
        })
}

fn encode_all(pcpu: u16, period: u64, recs: &[Record], frames: &[u64], sizes: &[usize]) -> Vec<u8> {
    let mut enc = BlockEncoder::new(pcpu, period);
    let mut out = Vec::new();
    let mut rest = recs;
    let mut rest_frames = frames;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes[i % sizes.len()].clamp(1, rest.len());
        let f = chain_frames(&rest[..n]);
        i += 1;
        let mut buf = vec![0u8; max_block_frame_len(n, f)];
        let len = enc
            .encode(&rest[..n], &rest_frames[..f], i as u64, &mut buf)
            .unwrap();
        // The size bound is honest: the frame fits in the bound for its own record count.
        assert!(len <= max_block_frame_len(n, f));
        out.extend_from_slice(&buf[..len]);
        rest = &rest[n..];
        rest_frames = &rest_frames[f..];
    }
    let mut end = vec![0u8; max_end_frame_len(1)];
    let n = encode_end(&[enc.totals(i as u64)], &mut end).unwrap();
    out.extend_from_slice(&end[..n]);
    out
}

/// `PROPTEST_CASES` overrides the default number of cases (for long local runs).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    #[test]
    fn records_round_trip(
        (recs, frames) in chained_records(400),
        sizes in prop::collection::vec(1usize..130, 1..4),
        period in prop_oneof![Just(1_000_000u64), any::<u64>()],
        pcpu in any::<u16>(),
    ) {
        let bytes = encode_all(pcpu, period, &recs, &frames, &sizes);
        let d = decode(&bytes);
        prop_assert!(d.damaged.is_empty(), "{:?}", d.damaged);
        prop_assert!(d.text.is_empty());
        prop_assert!(d.is_complete());
        let log = &d.pcpus[&pcpu];
        prop_assert_eq!(&log.records, &recs);
        prop_assert_eq!(&log.frames, &frames);
        prop_assert_eq!(log.blocks_lost, 0);
        let samples = recs.iter().filter(|r| r.as_sample().is_some()).count() as u64;
        prop_assert_eq!(log.totals.unwrap().samples, samples);
        prop_assert_eq!(log.totals.unwrap().events, recs.len() as u64 - samples);
    }

    #[test]
    fn block_header_fields_round_trip(
        pcpu in any::<u16>(), seq in any::<u64>(), first_sample in any::<u64>(),
        first_event in any::<u64>(), ring_drops in any::<u64>(), period_ticks in any::<u64>(),
        recs in records(20),
    ) {
        let h = BlockHeader { pcpu, seq, first_sample, first_event, ring_drops, period_ticks };
        let mut buf = vec![0u8; max_block_frame_len(recs.len(), 0)];
        let n = encode_block(&h, &recs, &[], &mut buf).unwrap();
        let frame = &buf[..n];
        prop_assert_eq!(frame[0], 0);
        prop_assert_eq!(frame[n - 1], 0);
        prop_assert!(!frame[1..n - 1].contains(&0));
        let mut got = None;
        let mut dec = StreamDecoder::new();
        dec.feed(frame, &mut |item| {
            if let Item::Block { header, records, offset, .. } = item {
                got = Some((header, records.to_vec(), offset));
            }
        });
        dec.finish(&mut |_| {});
        let (header, records, offset) = got.expect("block decoded");
        prop_assert_eq!(header, h);
        prop_assert_eq!(records, recs);
        prop_assert_eq!(offset, 1);
    }

    #[test]
    fn header_round_trips(
        vms in prop::collection::vec(
            (any::<u16>(), "\\PC{0,40}", any::<u16>(), "[a-z0-9.\\-]{0,80}", prop::collection::vec(any::<u8>(), 0..=20)),
            0..=MAX_VMS,
        ),
        build_id in prop::collection::vec(any::<u8>(), 0..=20),
        tsc_hz in any::<u64>(), pcpus in any::<u16>(), tsc_skew in any::<u64>(),
        period_ticks in any::<u64>(), source in any::<u8>(), version in any::<u16>(),
    ) {
        let mut h = Header {
            version,
            build_id: BuildId::new(&build_id).unwrap(),
            tsc_hz, pcpus, tsc_skew, period_ticks, source,
            ..Header::default()
        };
        for (id, name, vcpus, image, bid) in &vms {
            h.vms.push(VmInfo {
                id: *id,
                name: FixedStr::truncated(name),
                vcpus: *vcpus,
                image: FixedStr::truncated(image),
                image_build_id: BuildId::new(bid).unwrap(),
            }).unwrap();
        }
        let mut buf = vec![0u8; MAX_HEADER_FRAME_LEN];
        let n = encode_header(&h, &mut buf).unwrap();
        // Sent twice (start and end): identical copies are not conflicts.
        let mut bytes = buf[..n].to_vec();
        bytes.extend_from_slice(&buf[..n]);
        let d = decode(&bytes);
        prop_assert_eq!(d.header.as_ref(), Some(&h));
        prop_assert_eq!(d.header_frames, 2);
        prop_assert_eq!(d.header_conflicts, 0);
        prop_assert!(d.damaged.is_empty());
    }

    #[test]
    fn task_round_trips(
        tasks in prop::collection::vec(
            (any::<u16>(), any::<u64>(), any::<u16>(), any::<u16>(), any::<u64>(), any::<u64>(),
             any::<u32>(), any::<u32>(), "\\PC{0,20}"),
            1..8,
        ),
    ) {
        let tasks: Vec<Task> = tasks
            .into_iter()
            .map(|(pcpu, tsc, vm, vcpu, cr3, task, pid, tgid, comm)| Task {
                pcpu, tsc, vm, vcpu, cr3, task, pid, tgid,
                comm: FixedStr::truncated(&comm),
            })
            .collect();
        let mut bytes = b"console text\n".to_vec();
        let mut buf = vec![0u8; MAX_TASK_FRAME_LEN];
        for t in &tasks {
            let n = encode_task(t, &mut buf).unwrap();
            bytes.extend_from_slice(&buf[..n]);
            bytes.extend_from_slice(b"\r\n");
        }
        let d = decode(&bytes);
        prop_assert_eq!(&d.tasks, &tasks);
        prop_assert!(d.damaged.is_empty());
        prop_assert_eq!(d.unknown_frames, 0);
        let (p, _) = decode_parallel(&bytes, 3, || (), |_, _, _, _| {});
        prop_assert_eq!(&p.tasks, &tasks);
    }

    #[test]
    fn vm_end_round_trips(
        vm in any::<u16>(),
        lstar in u64_field(),
        offsets in prop::option::of((any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>())),
        exits in prop::collection::vec((0u16..100, prop_oneof![0u64..5000, any::<u64>()]), 0..200),
        ports in prop::collection::vec(0u16..24, 0..60),
        ple in prop::option::of((any::<bool>(), any::<u32>(), any::<u32>(), any::<u64>())),
        sites in prop::collection::vec((any::<u16>(), any::<u64>(), 1u64..u64::MAX), 0..80),
        vpmu in prop::option::of((any::<bool>(), prop::collection::vec((any::<u16>(), any::<[u64; 8]>()), 1..12))),
        isolation in prop::option::of(any::<bool>()),
    ) {
        let mut stats = ExitStats::new();
        for (reason, ticks) in exits {
            stats.record(reason, ticks);
        }
        for port in ports {
            stats.record_port(port);
        }
        let v = VmEnd {
            vm,
            lstar,
            task_offsets: offsets.map(|(current_task, pid, tgid, comm)| TaskOffsets {
                current_task, pid, tgid, comm,
            }),
            exits: stats,
            pause_loop: ple.map(|(directed, gap, window, others)| {
                let mut p = PauseLoop::new(directed, gap, window);
                p.others = others;
                for (vcpu, rip, exits) in sites {
                    p.add(SpinSite { vcpu, rip, exits });
                }
                p
            }),
            vpmu: vpmu.map(|(domain, vcpus)| {
                let mut p = VpmuEnd::new(domain);
                for (vcpu, [guest_ticks, emulated, hypervisor_ticks, pmis, held, undelivered, exits, exit_ticks]) in vcpus {
                    p.add(VpmuCounts { vcpu, guest_ticks, emulated, hypervisor_ticks, pmis, held, undelivered, exits, exit_ticks });
                }
                p
            }),
            page_table_isolation: isolation,
        };
        let mut buf = vec![0u8; MAX_VM_END_FRAME_LEN];
        let n = encode_vm_end(&v, &mut buf).unwrap();
        let mut bytes = b"vm x: exits\n".to_vec();
        bytes.extend_from_slice(&buf[..n]);
        let d = decode(&bytes);
        prop_assert_eq!(&d.vm_ends, &vec![v.clone()]);
        prop_assert!(d.damaged.is_empty());
        prop_assert_eq!(d.unknown_frames, 0);
        let (p, _) = decode_parallel(&bytes, 2, || (), |_, _, _, _| {});
        prop_assert_eq!(&p.vm_ends, &vec![v]);
    }

    #[test]
    fn mapping_round_trips(
        maps in prop::collection::vec(
            (any::<u16>(), any::<u64>(), any::<u16>(), any::<u16>(), any::<bool>(), u64_field(),
             any::<u32>(), u64_field(), 1u64..1 << 40, any::<u64>(), "\\PC{0,300}",
             prop::collection::vec(any::<u8>(), 0..=20)),
            1..6,
        ),
    ) {
        let maps: Vec<Mapping> = maps
            .into_iter()
            .map(|(pcpu, tsc, vm, vcpu, module, cr3, tgid, start, len, pgoff, path, id)| Mapping {
                pcpu, tsc, vm, vcpu,
                kind: if module { MappingKind::Module } else { MappingKind::Process },
                cr3, tgid,
                start,
                end: start.saturating_add(len),
                pgoff,
                path: FixedStr::truncated(&path),
                build_id: BuildId::new(&id).unwrap(),
            })
            .filter(|m| m.start < m.end)
            .collect();
        let mut bytes = b"text\n".to_vec();
        let mut buf = vec![0u8; MAX_MAPPING_FRAME_LEN];
        for m in &maps {
            let n = encode_mapping(m, &mut buf).unwrap();
            bytes.extend_from_slice(&buf[..n]);
        }
        let d = decode(&bytes);
        prop_assert_eq!(&d.mappings, &maps);
        prop_assert!(d.damaged.is_empty());
        let (p, _) = decode_parallel(&bytes, 2, || (), |_, _, _, _| {});
        prop_assert_eq!(&p.mappings, &maps);
    }

    #[test]
    fn output_round_trips(
        chunks in prop::collection::vec(
            (0u16..3, any::<bool>(), prop::collection::vec(any::<u8>(), 1..=MAX_OUTPUT_CHUNK)),
            1..12,
        ),
        lost in any::<u64>(),
    ) {
        // Bytes of every value (NUL, the frame delimiter, included) come back whole, per VM and
        // stream in the order written, between console text; a lost count adds up.
        let mut bytes = b"text\n".to_vec();
        let mut buf = vec![0u8; MAX_OUTPUT_FRAME_LEN];
        let mut want: std::collections::BTreeMap<(u16, OutputStream), Vec<u8>> = Default::default();
        for (vm, err, data) in &chunks {
            let stream = if *err { OutputStream::Stderr } else { OutputStream::Stdout };
            let o = Output { vm: *vm, stream, lost: 0, bytes: data };
            let n = encode_output(&o, &mut buf).unwrap();
            bytes.extend_from_slice(&buf[..n]);
            bytes.extend_from_slice(b"more text\r\n");
            want.entry((*vm, stream)).or_default().extend_from_slice(data);
        }
        let o = Output { vm: 1, stream: OutputStream::Lost, lost, bytes: &[] };
        let n = encode_output(&o, &mut buf).unwrap();
        bytes.extend_from_slice(&buf[..n]);
        let d = decode(&bytes);
        prop_assert_eq!(&d.output, &want);
        prop_assert_eq!(d.output_lost.get(&1), Some(&lost));
        prop_assert!(d.damaged.is_empty());
        let (p, _) = decode_parallel(&bytes, 3, || (), |_, _, _, _| {});
        prop_assert_eq!(&p.output, &want);
    }

    #[test]
    fn pcpu_cost_round_trips(pcpu in any::<u16>(), f in prop::array::uniform10(u64_field())) {
        let c = PcpuCost {
            pcpu,
            span_ticks: f[0],
            samples: f[1],
            sampling_exits: f[2],
            sampling_exit_ticks: f[3],
            timer_interrupts: f[4],
            timer_ticks: f[5],
            other_sample_ticks: f[6],
            export_ticks: f[7],
            task_reads: f[8],
            task_read_ticks: f[9],
        };
        let mut buf = vec![0u8; MAX_PCPU_COST_FRAME_LEN];
        let n = encode_pcpu_cost(&c, &mut buf).unwrap();
        let d = decode(&buf[..n]);
        prop_assert_eq!(&d.costs, &vec![c]);
        prop_assert!(d.damaged.is_empty());
    }

    #[test]
    fn end_round_trips(totals in prop::collection::vec(
        (any::<u16>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>())
            .prop_map(|(pcpu, samples, events, ring_drops, blocks)| PcpuTotals { pcpu, samples, events, ring_drops, blocks }),
        0..50,
    )) {
        let mut buf = vec![0u8; max_end_frame_len(totals.len())];
        let n = encode_end(&totals, &mut buf).unwrap();
        let d = decode(&buf[..n]);
        prop_assert_eq!(d.end.as_ref(), Some(&totals));
    }

    #[test]
    fn streaming_in_any_chunks_equals_whole(cuts in prop::collection::vec(0usize..20_000, 0..30), seed in 0u64..1000) {
        let cap = synth::capture(
            &SynthConfig { seed, samples_per_pcpu: 600, pcpus: 3, ..SynthConfig::default() },
            &CaptureOptions { console_every: 4, ..CaptureOptions::default() },
        );
        let whole = decode(&cap.bytes);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (cap.bytes.len() + 1)).collect();
        cuts.sort_unstable();
        let mut dec = StreamDecoder::new();
        let mut col = hvprof_samplelog::Collector::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([cap.bytes.len()]) {
            dec.feed(&cap.bytes[prev..c], &mut |item| col.push(item));
            prev = c;
        }
        dec.finish(&mut |item| col.push(item));
        let streamed = col.finish(dec.position());
        prop_assert_eq!(streamed, whole);
    }
}

#[test]
fn synthetic_capture_round_trips() {
    let cfg = SynthConfig {
        samples_per_pcpu: 5000,
        ..SynthConfig::default()
    };
    let trace = synth::generate(&cfg);
    let cap = synth::capture(
        &cfg,
        &CaptureOptions {
            header_at_end: true,
            ..CaptureOptions::default()
        },
    );
    let d = decode(&cap.bytes);
    assert!(d.is_complete(), "{d:?}");
    assert!(d.damaged.is_empty());
    assert_eq!(d.header.as_ref(), Some(&trace.header));
    assert_eq!(d.header_frames, 2);
    assert_eq!(d.pcpus.len(), trace.pcpus.len());
    for p in &trace.pcpus {
        let log = &d.pcpus[&p.pcpu];
        assert_eq!(log.records, p.records);
        assert_eq!(log.ring_drops, p.ring_drops);
        // Nothing lost on the way: the only gaps are the samples the hypervisor dropped, and
        // they add up to its count.
        assert!(
            log.gaps
                .iter()
                .all(|g| g.blocks == 0 && g.samples == 0 && !g.truncated)
        );
        assert_eq!(
            log.gaps.iter().map(|g| g.dropped).sum::<u64>(),
            p.ring_drops
        );
    }
    assert_eq!(d.samples(), cap.samples);
}

#[test]
fn encoding_is_deterministic() {
    let cfg = SynthConfig {
        samples_per_pcpu: 2000,
        ..SynthConfig::default()
    };
    let a = synth::capture(&cfg, &CaptureOptions::default());
    let b = synth::capture(&cfg, &CaptureOptions::default());
    assert_eq!(a.bytes, b.bytes);
}

#[test]
fn out_of_order_and_duplicate_blocks_are_put_in_order() {
    let cfg = SynthConfig {
        samples_per_pcpu: 1000,
        pcpus: 2,
        ..SynthConfig::default()
    };
    let cap = synth::capture(&cfg, &CaptureOptions::default());
    let mut frames: Vec<&[u8]> = cap
        .frames
        .iter()
        .map(|f| &cap.bytes[f.range.clone()])
        .collect();
    let end = frames.pop().unwrap();
    frames[1..].reverse();
    frames.push(frames[3]);
    frames.push(end);
    let d = decode(&frames.concat());
    let whole = decode(&cap.bytes);
    assert!(d.is_complete());
    for (pcpu, log) in &d.pcpus {
        assert_eq!(log.records, whole.pcpus[pcpu].records);
    }
    assert_eq!(d.pcpus.values().map(|p| p.duplicate_blocks).sum::<u64>(), 1);
}

/// The largest VM end frame there can be (every reason, every bucket, every port, every field at
/// its widest) fits `MAX_VM_END_FRAME_LEN`, and one byte less of buffer is refused, not
/// overrun.
#[test]
fn worst_case_vm_end_fits_the_advertised_bound() {
    let mut e = ExitStats::new();
    for r in 0..EXIT_REASONS as u16 {
        e.set_reason(
            r,
            ReasonStats {
                count: u64::MAX,
                total: u64::MAX,
                min: u64::MAX,
                max: u64::MAX,
                histogram: [u32::MAX; HISTOGRAM_BUCKETS],
            },
        );
    }
    for p in 0..EXIT_PORTS as u16 {
        e.add_port_count(0xff00 | p, u64::MAX);
    }
    e.other = u64::MAX;
    e.ports_other = u64::MAX;
    let v = VmEnd {
        vm: u16::MAX,
        lstar: u64::MAX,
        task_offsets: Some(TaskOffsets {
            current_task: u64::MAX,
            pid: u32::MAX,
            tgid: u32::MAX,
            comm: u32::MAX,
        }),
        exits: e,
        pause_loop: Some({
            let mut p = PauseLoop::new(true, u32::MAX, u32::MAX);
            for i in 0..MAX_SPIN_SITES as u16 {
                p.add(SpinSite {
                    vcpu: u16::MAX - i,
                    rip: u64::MAX - u64::from(i),
                    exits: u64::MAX,
                });
            }
            p.others = u64::MAX;
            p
        }),
        vpmu: Some({
            let mut p = VpmuEnd::new(true);
            for i in 0..MAX_VPMU_VCPUS as u16 {
                p.add(VpmuCounts {
                    vcpu: u16::MAX - i,
                    guest_ticks: u64::MAX,
                    emulated: u64::MAX,
                    hypervisor_ticks: u64::MAX,
                    pmis: u64::MAX,
                    held: u64::MAX,
                    undelivered: u64::MAX,
                    exits: u64::MAX,
                    exit_ticks: u64::MAX,
                });
            }
            p
        }),
        page_table_isolation: Some(false),
    };
    let mut buf = vec![0u8; MAX_VM_END_FRAME_LEN];
    let n = encode_vm_end(&v, &mut buf).unwrap();
    assert_eq!(decode(&buf[..n]).vm_ends, vec![v.clone()]);
    // A buffer exactly the frame's size may not be enough (in-place COBS), but a much smaller
    // one is refused cleanly.
    let mut small = vec![0u8; n / 2];
    assert!(encode_vm_end(&v, &mut small).is_err());
}

#[test]
fn limits_are_enforced() {
    let recs = vec![Record::Sample(Sample::default()); MAX_BLOCK_RECORDS + 1];
    let mut buf = vec![0u8; max_block_frame_len(MAX_BLOCK_RECORDS + 1, 0)];
    assert_eq!(
        encode_block(&BlockHeader::default(), &recs, &[], &mut buf),
        Err(hvprof_samplelog::EncodeError::TooManyRecords)
    );
    let n = encode_block(&BlockHeader::default(), &recs[1..], &[], &mut buf).unwrap();
    assert_eq!(decode(&buf[..n]).pcpus[&0].records.len(), MAX_BLOCK_RECORDS);
    let mut list = hvprof_samplelog::VmList::new();
    for _ in 0..MAX_VMS {
        list.push(VmInfo::default()).unwrap();
    }
    assert!(list.push(VmInfo::default()).is_err());
    assert!(FixedStr::<4>::try_from_str("hello").is_err());
    assert_eq!(FixedStr::<4>::truncated("h\u{e9}llo").as_str(), "h\u{e9}l");
    assert_eq!(FixedStr::<2>::truncated("\u{e9}\u{e9}").as_str(), "\u{e9}");
    assert!(BuildId::new(&[1; 21]).is_err());
}

#[test]
fn worst_case_records_fit_the_advertised_bound() {
    let lo = Sample {
        tsc: 0,
        kind: SampleKind::Guest,
        vm: 0,
        vcpu: 0,
        vpid: 0,
        guest_rip: 0,
        guest_cr3: 0,
        guest_mode: 0,
        exit_reason: 0,
        host_rip: 0,
        cost: 0,
        ..Default::default()
    };
    let hi = Sample {
        tsc: u64::MAX / 2,
        kind: SampleKind::Idle,
        vm: u16::MAX,
        vcpu: u16::MAX,
        vpid: u16::MAX,
        guest_rip: 1 << 63,
        guest_cr3: 1 << 63,
        guest_mode: 0xff,
        exit_reason: u16::MAX,
        host_rip: 1 << 63,
        cost: u32::MAX,
        ..Default::default()
    };
    let mid = Sample {
        kind: SampleKind::Hypervisor,
        ..hi
    };
    let ev = Event {
        tsc: u64::MAX / 2 + 1,
        kind: EventKind::VcpuOut,
        vm: 0x8000,
        vcpu: 0x8000,
        reason: OutReason::Yielded,
    };
    let mut recs = Vec::new();
    for i in 0..MAX_BLOCK_RECORDS {
        recs.push(match i % 4 {
            0 => Record::Sample(lo),
            1 => Record::Sample(hi),
            2 => Record::Event(ev),
            _ => Record::Sample(mid),
        });
    }
    for n in [1, 2, 3, 4, 64, MAX_BLOCK_RECORDS] {
        let mut buf = vec![0u8; max_block_frame_len(n, 0)];
        let len = encode_block(&BlockHeader::default(), &recs[..n], &[], &mut buf).unwrap();
        assert!(len <= buf.len());
        assert_eq!(decode(&buf[..len]).pcpus[&0].records, recs[..n]);
    }
}
