//! `report --preemptions` on a capture whose truth is known by construction: one VM, two vCPUs
//! on one pCPU taking turns (the paper's Tables 8/9), each running `mix` (work_a 80 % and
//! work_b 20 % of its time). A slice ends at a moment unrelated to the guest's code, so the
//! places a vCPU is preempted in follow its time: work_a about 80 % of its preemptions. Every
//! preemption that ended is counted once, with the exact ticks out from its events.

use hvprof_analyze::model::profile::{LoadOptions, Profile};
use hvprof_analyze::model::progress::Progress;
use hvprof_analyze::naming::symbols::{Images, Symbols};
use hvprof_analyze::views::preemption;
use hvprof_samplelog::{EventKind, OutReason};

use crate::data;

fn profile() -> Profile {
    let images = Images {
        hypervisor: Some(Symbols::load(&data("hvprof-3a995a71.sym")).unwrap()),
        guests: vec![Symbols::load(&data("mix.elf")).unwrap()],
        kernel: None,
        ..Images::default()
    };
    Profile::from_bytes(
        &std::fs::read(data("sched-2vcpus-1pcpu.log")).unwrap(),
        &images,
        LoadOptions::all(2),
        &Progress::hidden(),
    )
}

#[test]
fn preemptions_fall_where_the_time_goes_and_count_the_steal_that_followed() {
    let p = profile();
    let v = preemption::build(&p).unwrap();
    assert_eq!(v.len(), 2, "{v:#?}");
    for c in &v {
        // The events' own count: every out while runnable that an "in" ended.
        let mut open = None;
        let (mut times, mut ticks) = (0u64, 0u64);
        for (_, e) in p.events.iter().filter(|(_, e)| e.vcpu == c.vcpu) {
            match (e.kind, e.reason) {
                (EventKind::VcpuOut, OutReason::Preempted | OutReason::Yielded) => {
                    open = Some(e.tsc);
                }
                (EventKind::VcpuOut, _) => open = None,
                (EventKind::VcpuIn, _) => {
                    if let Some(t) = open.take() {
                        times += 1;
                        ticks += e.tsc - t;
                    }
                }
            }
        }
        assert!(times > 300, "{times}");
        assert_eq!((c.times, c.ticks), (times, ticks), "vCPU {}", c.vcpu);
        assert_eq!(c.places.iter().map(|p| p.times).sum::<u64>(), times);
        assert_eq!(c.places.iter().map(|p| p.ticks).sum::<u64>(), ticks);
        let percent: f64 = c.places.iter().map(|p| p.percent).sum();
        assert!((percent - 100.0).abs() < 1e-6);
        // By construction: 80 % work_a, 20 % work_b (350 preemptions: σ about 2 points).
        let share = |f: &str| {
            c.places
                .iter()
                .filter(|p| p.function == f && p.module == "mix.elf")
                .map(|p| p.percent)
                .sum::<f64>()
        };
        assert!((share("work_a") - 80.0).abs() < 8.0, "{c:#?}");
        assert!((share("work_b") - 20.0).abs() < 8.0, "{c:#?}");
        // Most ticks first.
        assert!(c.places.windows(2).all(|w| w[0].ticks >= w[1].ticks));
    }
    let text = preemption::render(&v, 5, p.tsc_hz);
    assert!(
        text.contains("Preempted in: VM guestOS1 vCPU 0: "),
        "{text}"
    );
    assert!(text.contains("work_a  mix.elf"), "{text}");
}
