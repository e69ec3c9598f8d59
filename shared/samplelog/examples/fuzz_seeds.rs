//! Writes small seed inputs for the fuzz targets (`docs/FUZZING.md`): synthetic captures with
//! every frame type, console text, a second header, a duplicate block, lost blocks and task
//! frames, each a few KiB.
//!
//! `cargo run -p hvprof-samplelog --features std --example fuzz_seeds -- <dir>`

use std::path::PathBuf;

use hvprof_samplelog::synth::{self, CaptureOptions, FrameKind, SynthConfig};
use hvprof_samplelog::{
    ExitStats, FixedStr, MAX_PCPU_COST_FRAME_LEN, MAX_TASK_FRAME_LEN, MAX_VM_END_FRAME_LEN,
    PcpuCost, Task, TaskOffsets, VmEnd, encode_pcpu_cost, encode_task, encode_vm_end,
};

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "seeds".into()));
    std::fs::create_dir_all(&dir)?;
    let mut n = 0;
    for (seed, pcpus, samples, block_records, console_every) in [
        (1, 1, 40, 16, 0),
        (2, 2, 60, 16, 3),
        (3, 3, 30, 8, 2),
        (4, 4, 80, 32, 0),
        (5, 2, 200, 64, 5),
    ] {
        let cfg = SynthConfig {
            seed,
            pcpus,
            samples_per_pcpu: samples,
            ..SynthConfig::default()
        };
        let cap = synth::capture(
            &cfg,
            &CaptureOptions {
                block_records,
                console_every,
                header_at_end: seed % 2 == 0,
                ..CaptureOptions::default()
            },
        );
        std::fs::write(dir.join(format!("synth-{seed}")), &cap.bytes)?;
        n += 1;
        // Variants: a block lost, a block sent twice, task frames after the header.
        let blocks: Vec<_> = cap
            .frames
            .iter()
            .filter(|f| matches!(f.kind, FrameKind::Block { .. }))
            .collect();
        if let Some(b) = blocks.get(1) {
            let mut lost = cap.bytes.clone();
            lost.drain(b.range.clone());
            std::fs::write(dir.join(format!("synth-{seed}-lost")), &lost)?;
            let mut dup = cap.bytes.clone();
            dup.extend_from_slice(&cap.bytes[b.range.clone()]);
            std::fs::write(dir.join(format!("synth-{seed}-dup")), &dup)?;
            n += 2;
        }
        let mut tasks = cap.bytes.clone();
        let at = cap.frames.first().map_or(0, |f| f.range.end);
        let mut buf = [0u8; MAX_TASK_FRAME_LEN];
        let mut frames = Vec::new();
        for (i, comm) in ["init", "evil\n\u{1b}[2J", "worker"].iter().enumerate() {
            let t = Task {
                pcpu: 0,
                tsc: 1_000 * i as u64,
                vm: i as u16,
                vcpu: 0,
                cr3: 0x1000 * (i as u64 + 1),
                task: 0xffff_8880_0000_0000 + i as u64,
                pid: 100 + i as u32,
                tgid: 100,
                comm: FixedStr::truncated(comm),
            };
            let len = encode_task(&t, &mut buf).expect("task frame fits");
            frames.extend_from_slice(&buf[..len]);
        }
        // A VM end frame and a pCPU cost frame, as the hypervisor sends them at the end.
        let mut exits = ExitStats::new();
        for (reason, ticks) in [(10, 400), (10, 900), (30, 5_000), (48, 2_000_000), (99, 1)] {
            exits.record(reason, ticks);
        }
        exits.record_port(0x3f8);
        let vm_end = VmEnd {
            vm: 0,
            lstar: 0xffff_ffff_8160_0040,
            task_offsets: Some(TaskOffsets {
                current_task: 0x2_1440,
                pid: 0x5d0,
                tgid: 0x5d4,
                comm: 0x758,
            }),
            exits,
            pause_loop: Some({
                let mut p = hvprof_samplelog::PauseLoop::new(true, 128, 4096);
                p.add(hvprof_samplelog::SpinSite {
                    vcpu: 0,
                    rip: 0xffff_ffff_8110_2233,
                    exits: 57,
                });
                p
            }),
            vpmu: Some({
                let mut p = hvprof_samplelog::VpmuEnd::new(false);
                p.add(hvprof_samplelog::VpmuCounts {
                    vcpu: 0,
                    guest_ticks: 1_676_459,
                    emulated: 1_466,
                    hypervisor_ticks: 0,
                    pmis: 100,
                    held: 80,
                    undelivered: 0,
                    exits: 58_318,
                    exit_ticks: 95_000_000,
                });
                p
            }),
            page_table_isolation: Some(true),
        };
        let mut big = vec![0u8; MAX_VM_END_FRAME_LEN];
        let len = encode_vm_end(&vm_end, &mut big).expect("VM end frame fits");
        frames.extend_from_slice(&big[..len]);
        let mut small = [0u8; MAX_PCPU_COST_FRAME_LEN];
        let cost = PcpuCost {
            pcpu: 0,
            span_ticks: 1_000_000,
            samples: 1_000,
            sampling_exits: 900,
            sampling_exit_ticks: 270_000,
            ..PcpuCost::default()
        };
        let len = encode_pcpu_cost(&cost, &mut small).expect("cost frame fits");
        frames.extend_from_slice(&small[..len]);
        tasks.splice(at..at, frames);
        std::fs::write(dir.join(format!("synth-{seed}-tasks")), &tasks)?;
        n += 1;
    }
    println!("{n} seeds in {}", dir.display());
    Ok(())
}
