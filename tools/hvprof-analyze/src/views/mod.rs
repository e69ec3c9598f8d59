//! Every output of the profile: the report (text, JSON, HTML), the charts, the exports.

pub mod callgraph;
pub mod chart;
pub mod firefox;
pub mod flame;
pub mod html;
pub mod pprof;
pub mod preemption;
pub mod report;
pub mod script;
pub mod stat;
pub mod text;
