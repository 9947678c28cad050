//! The operator's tools, as an operator runs them.

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_tells_when_and_from_where_a_key_was_applied_and_its_duplicates() {
    let p = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = \"/id\"\n";
    let (_db, kafka, setup) = fixture("CREATE TABLE seen (k text);", "orders", 1, &[("orders.toml", p)]).await;
    kafka.produce(
        "orders",
        &[
            Out::json(0, r#"{"id":"o-1"}"#),
            Out::json(0, r#"{"id":"o-2"}"#),
            Out::json(0, r#"{"id":"o-1"}"#),
            Out::json(0, r#"{"id":"o-1", "v": 2}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 4).await;
    assert!(w.stop().await.is_empty());
    let cfg = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-1"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("from               orders/0@0"), "{out}");
    assert!(out.contains("duplicates skipped 2 since"), "{out}");
    let digest = out.lines().find(|l| l.contains("payload sha256")).unwrap().split_whitespace().last().unwrap().to_owned();
    assert_eq!(digest.len(), 64);
    let (_, out, _) = idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-2"], setup.dir.path());
    assert!(out.contains("from               orders/0@1") && out.contains("duplicates skipped 0 since"), "{out}");
    let (status, out, _) = idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-9"], setup.dir.path());
    assert!(status.success() && out.contains("not in the dedup store"), "{out}");
    let (status, _, err) = idemflow(&["explain", "--config", cfg, "--pipeline", "nope", "--key", "o-1"], setup.dir.path());
    assert!(!status.success() && err.contains("no pipeline named \"nope\""), "{err}");
}
