//! The fuzz corpus replayed as a test: every input kept under `fuzz/corpus/<target>/` (seeds, and any finding of
//! `cargo fuzz run <target>`, which is kept there as a regression) goes through the same code and invariants as the
//! fuzz target (`fuzz/src/lib.rs`), on the stable toolchain.

#[path = "../../fuzz/src/lib.rs"]
mod targets;

fn replay(target: &str, run: fn(&[u8])) {
    let dir = crate::support::project_root().join("fuzz/corpus").join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let result = std::panic::catch_unwind(|| run(&data));
        assert!(result.is_ok(), "fuzz/corpus/{target}/{} fails", path.file_name().unwrap().to_string_lossy());
        n += 1;
    }
    assert!(n > 0, "no input in {}", dir.display());
}

#[test]
fn the_fuzz_corpus_replays_without_a_failure() {
    replay("pipeline", targets::pipeline);
    replay("sql", targets::sql);
    replay("values", targets::values);
    replay("redis", targets::redis);
    replay("avro", targets::avro);
    replay("protobuf", targets::protobuf);
    replay("schema_text", targets::schema_text);
}
