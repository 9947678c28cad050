//! The demo's stream of payments: deterministic (the same every run), with what its outcome must be (distinct
//! operations, producer retries, reused order ids, poison records, the expected total).

use super::shipped::ACCOUNTS;

/// The message-id a payment is published with: its order id (a retry keeps it); a poison message gets its own.
pub(crate) fn message_id(index: usize, body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["order"]["id"].as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("poison-{index}"))
}

/// The stream the demo produces, and what the outcome must be.
pub(crate) struct Stream {
    /// `(partition, payload)` in production order.
    pub(crate) records: Vec<(i32, Vec<u8>)>,
    /// Distinct operations (order ids with their first amount).
    pub(crate) distinct: u64,
    /// Producer retries: an operation sent again, the same bytes.
    pub(crate) retries: u64,
    /// An order id sent again with another amount.
    pub(crate) mismatches: u64,
    /// Records that are not JSON.
    pub(crate) poison: u64,
    /// The sum of the distinct operations' amounts, in cents.
    pub(crate) expected_cents: i64,
}

/// A small deterministic generator (xorshift64), so every run produces the same stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn payment(order: u64, account: u64, cents: i64) -> Vec<u8> {
    format!(
        r#"{{"order":{{"id":"ORDERID_{order}","account":"ACC-{account}","amount":"{}.{:02}","currency":"USD"}},"paid_at":"2026-11-29T10:00:00+01:00"}}"#,
        cents / 100,
        cents % 100
    )
    .into_bytes()
}

pub(super) fn stream(records: usize, partitions: i32) -> Stream {
    stream_from(records, partitions, 100, 0x9e37_79b9_7f4a_7c15)
}

/// `records` records whose new operations use order ids from `first_order` on.
pub(crate) fn stream_from(records: usize, partitions: i32, first_order: u64, seed: u64) -> Stream {
    let mut rng = Rng(seed | 1);
    let mut s = Stream { records: Vec::with_capacity(records), distinct: 0, retries: 0, mismatches: 0, poison: 0, expected_cents: 0 };
    let mut sent: Vec<(u64, u64, i64)> = Vec::new();
    while s.records.len() < records {
        let roll = rng.next() % 1000;
        let partition_of = |order: u64| (order % partitions as u64) as i32;
        if roll < 20 && !sent.is_empty() {
            // A producer retry: the same operation again, a little later.
            let (order, account, cents) = sent[sent.len() - 1 - (rng.next() as usize % sent.len().min(50))];
            s.records.push((partition_of(order), payment(order, account, cents)));
            s.retries += 1;
        } else if roll < 23 && !sent.is_empty() {
            // The same order id with another amount: a bug upstream, caught as payload_mismatch.
            let (order, account, cents) = sent[rng.next() as usize % sent.len()];
            s.records.push((partition_of(order), payment(order, account, cents + 1)));
            s.mismatches += 1;
        } else if roll < 24 {
            let order = first_order + s.distinct;
            // Cut short: not JSON. Its place in the stream makes its bytes its own (the soak tells dead letters
            // apart by payload).
            s.records.push((partition_of(order), format!("{{\"order\": {{\"id\": \"ORDERID_{order}\", \"at\": {}", s.records.len()).into_bytes()));
            s.poison += 1;
        } else {
            let order = first_order + s.distinct;
            let account = rng.next() % ACCOUNTS as u64;
            let cents = 100 + (rng.next() % 50_000) as i64;
            s.records.push((partition_of(order), payment(order, account, cents)));
            sent.push((order, account, cents));
            s.distinct += 1;
            s.expected_cents += cents;
        }
    }
    s
}

/// `cents` as an amount with two decimals (`12345` is `123.45`).
pub(crate) fn money(cents: i64) -> String {
    format!("{}.{:02}", cents / 100, cents % 100)
}
