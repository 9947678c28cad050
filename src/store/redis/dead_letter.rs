//! Dead letters in Redis: the stream `<prefix>dead-letters`, one entry per dead letter, written by the batch's
//! script. Entry ids are `N-0`, `N` from a counter, so `idemflow dead-letters show N` names one as it does a row.
//! Fields: `pipeline topic partition offset reason error commands_done created_at meta payload` (`meta`: JSON with
//! the record key, headers and properties, see [`super::batch`]).

use super::batch::Meta;
use super::RedisStore;
use crate::dead_letter::Stored;
use std::collections::HashMap;

type Entry = (String, Vec<(String, Vec<u8>)>);

fn stored(entry: Entry) -> Option<Stored> {
    let (id, fields) = entry;
    let fields: HashMap<String, Vec<u8>> = fields.into_iter().collect();
    let text = |k: &str| fields.get(k).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
    let meta: Meta = serde_json::from_slice(fields.get("meta").map_or(&b"{}"[..], Vec::as_slice)).unwrap_or_default();
    let unhex = |h: &str| hex::decode(h).unwrap_or_else(|_| h.as_bytes().to_vec());
    let created = text("created_at").parse().map(super::format_ms).unwrap_or_default();
    Some(Stored {
        id: id.split_once('-').map_or(id.as_str(), |(n, _)| n).parse().ok()?,
        pipeline: text("pipeline"),
        topic: text("topic"),
        partition: text("partition").parse().ok()?,
        offset: text("offset").parse().ok()?,
        record_key: meta.key.as_deref().map(unhex),
        header_names: meta.headers.iter().map(|(k, _)| k.clone()).collect(),
        header_values: meta.headers.iter().map(|(_, v)| v.as_deref().map(unhex)).collect(),
        property_names: meta.properties.iter().map(|(k, _)| k.clone()).collect(),
        property_values: meta.properties.iter().map(|(_, v)| v.clone()).collect(),
        payload: if meta.null { None } else { Some(fields.get("payload").cloned().unwrap_or_default()) },
        payload_bytes: meta.size.map(|s| s as i64),
        payload_sha256: meta.sha256.as_deref().map(unhex),
        reason: text("reason"),
        error: text("error"),
        created_at: created,
        commands_done: text("commands_done").parse().ok().filter(|n| *n > 0),
    })
}

impl RedisStore {
    /// The newest `limit` dead letters, optionally of one pipeline.
    ///
    /// Errors: Redis's.
    pub async fn dead_letters(&self, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, redis::RedisError> {
        let mut out = Vec::new();
        let mut end = "+".to_owned();
        loop {
            let page: Vec<Entry> = redis::cmd("XREVRANGE").arg(self.dead_letter_stream()).arg(&end).arg("-").arg("COUNT").arg(500).query_async(&mut self.conn().await?).await?;
            let last = page.last().map(|(id, _)| id.clone());
            for d in page.into_iter().filter_map(stored) {
                if pipeline.is_none_or(|p| d.pipeline == p) && (out.len() as i64) < limit {
                    out.push(d);
                }
            }
            match last {
                Some(id) if (out.len() as i64) < limit => end = format!("({id}"),
                _ => return Ok(out),
            }
        }
    }

    /// One dead letter by id.
    ///
    /// Errors: Redis's.
    pub async fn dead_letter(&self, id: i64) -> Result<Option<Stored>, redis::RedisError> {
        let entry = format!("{id}-0");
        let page: Vec<Entry> = redis::cmd("XRANGE").arg(self.dead_letter_stream()).arg(&entry).arg(&entry).query_async(&mut self.conn().await?).await?;
        Ok(page.into_iter().next().and_then(stored))
    }
}
