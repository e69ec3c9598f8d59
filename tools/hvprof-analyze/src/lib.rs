//! `hvprof-analyze` as a library: the decoder's results turned into the unified profile (the
//! report's tables), and every view of it: the timeline chart, the flame graph, the exit
//! statistics, `perf script` text, pprof and Firefox Profiler files, the HTML page.
//! The binary (`main.rs`) is the command line over it.

pub mod chart;
pub mod cost;
pub mod firefox;
pub mod flame;
pub mod html;
pub mod linux;
pub mod naming;
pub mod pprof;
pub mod profile;
pub mod progress;
pub mod report;
pub mod script;
pub mod stat;
pub mod symbols;
pub mod text;
pub mod timeline;
