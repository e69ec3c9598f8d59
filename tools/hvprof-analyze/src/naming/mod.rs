//! What a sample is called: symbol files, a Linux guest's kernel, processes and modules, the
//! escaping every name from the log or a guest image goes through, and the one place that
//! decides every name ([`namer`]). Uses nothing else of the analyzer.

pub mod discover;
pub mod eh_frame;
pub mod escape;
pub mod linux;
pub mod modules;
pub mod namer;
pub mod symbols;
