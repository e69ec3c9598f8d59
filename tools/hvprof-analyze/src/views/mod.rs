//! Where each output of the profile is written: the report (text, JSON, HTML), the call graph,
//! the preemptions, the exit statistics, the charts, `perf script`, pprof and Firefox. Uses
//! `model` and `naming`.

pub mod callgraph;
pub mod chart;
pub mod diff;
pub mod firefox;
pub mod flame;
pub mod html;
pub mod pprof;
pub mod preemption;
pub mod report;
pub mod script;
pub mod stat;
pub mod stolen;
pub mod text;
