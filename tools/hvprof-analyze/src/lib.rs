//! `hvprof-analyze` as a library: a serial capture turned into the unified profile of the machine
//! and every output of it, and the live commands over a stream as it arrives. The binary
//! (`main.rs`) is the command line over it.
//!
//! Four folders, whose uses go one way (`cargo test -p xtask modgraph` checks it):
//! - [`naming`]: what a sample is called (symbol files, a Linux guest's kernel, tasks and
//!   modules, every name decided in one place); uses none of the others;
//! - [`model`]: the capture's model, where a sample is attributed: decoded, classified and
//!   counted, its stacks named, read again in time order, with what the capture lost; uses
//!   `naming`;
//! - [`views`]: where each output is written (the report, text, HTML, charts, exports); uses
//!   `model` and `naming`;
//! - [`live`]: `record` and `top` over a stream; uses `model` and `naming`.

pub mod live;
pub mod model;
pub mod naming;
pub mod views;
