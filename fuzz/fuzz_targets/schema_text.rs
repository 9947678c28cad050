#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| idemflow_fuzz::schema_text(data));
