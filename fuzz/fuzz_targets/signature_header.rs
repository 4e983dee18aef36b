//! Signature header parsing and verification must never panic, whatever the provider (or an
//! attacker) sends, and must never accept a body it did not sign. The property lives in
//! `checks/`, which `cargo test` also runs over the kept corpus.
#![no_main]

#[path = "../checks/signature_header.rs"]
mod check;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| check::check(data));
