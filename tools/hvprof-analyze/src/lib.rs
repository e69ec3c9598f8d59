//! `hvprof-analyze` as a library: the decoder's results turned into the unified profile (the
//! report's tables), and every view of it: the timeline chart, the flame graph, the exit
//! statistics, `perf script` text, pprof and Firefox Profiler files, the HTML page; and the live
//! commands over a stream as it arrives (`record`, `top`).
//! The binary (`main.rs`) is the command line over it.

pub mod live;
pub mod model;
pub mod naming;
pub mod views;
