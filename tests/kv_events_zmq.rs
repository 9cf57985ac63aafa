//! KV-cache events over real ZMQ on loopback: our publisher (the emulator's) and subscriber
//! (the router's) — in-order delivery, a late subscriber catching up from the replay endpoint,
//! a lost batch replayed, a gap beyond the replay buffer and a publisher without replay turned
//! into a counted resync, a publisher restart, and a garbage message dropped and counted.

use cacheroute::telemetry::kv_events::{Encoding, EventBatch, WireEvent};
use cacheroute::telemetry::kv_zmq::{subscribe, Delivery, Publisher, SubscriberStats};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

fn batch(i: u64) -> EventBatch {
    EventBatch {
        ts: i as f64,
        events: vec![WireEvent::Stored {
            blocks: vec![1000 + i],
            parent: (i > 0).then(|| 999 + i),
            token_ids: (0..16).collect(),
            block_size: 16,
            medium: None,
        }],
        data_parallel_rank: None,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Delivery>) -> Delivery {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a delivery within 10 s")
        .expect("subscriber alive")
}

fn seq_of(d: &Delivery) -> Option<u64> {
    match d {
        Delivery::Batch(m) => Some(m.seq),
        Delivery::Resync => None,
    }
}

/// Start a subscriber to `p` and wait until it is connected (publish a probe until one
/// arrives): returns the receiver, its counters, and the probe count published.
async fn connected(
    p: &mut Publisher,
    replay: bool,
) -> (mpsc::UnboundedReceiver<Delivery>, Arc<SubscriberStats>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(SubscriberStats::default());
    tokio::spawn(subscribe(
        p.endpoint.clone(),
        if replay {
            p.replay_endpoint.clone()
        } else {
            None
        },
        "kv".into(),
        tx,
        stats.clone(),
    ));
    (rx, stats)
}

#[test]
fn in_order_late_join_replay_and_loss() {
    rt().block_on(async {
        for enc in [Encoding::TaggedMap, Encoding::TaggedArray] {
            let mut p = Publisher::bind(
                "tcp://127.0.0.1:0",
                Some("tcp://127.0.0.1:0"),
                "kv",
                100,
                enc,
            )
            .await
            .unwrap();
            // Published before anyone listens: only the replay endpoint can give them back.
            for i in 0..3 {
                p.publish(&batch(i)).await.unwrap();
            }
            let (mut rx, stats) = connected(&mut p, true).await;
            // Keep publishing until the subscriber has seen one (ZMQ's slow joiner).
            let mut i = 3;
            let first = loop {
                p.publish(&batch(i)).await.unwrap();
                i += 1;
                if let Ok(Some(d)) =
                    tokio::time::timeout(Duration::from_millis(100), rx.recv()).await
                {
                    break d;
                }
            };
            // The late subscriber got everything from 0, in order, from the replay endpoint.
            assert_eq!(seq_of(&first), Some(0), "{enc:?}");
            let mut seen = vec![0];
            while seen.len() < i as usize {
                seen.push(seq_of(&next(&mut rx).await).expect("no resync"));
            }
            assert_eq!(seen, (0..i).collect::<Vec<_>>(), "{enc:?}");
            // A batch lost on the way is replayed before the next one.
            p.lose_next(&batch(i));
            p.publish(&batch(i + 1)).await.unwrap();
            let a = next(&mut rx).await;
            let b = next(&mut rx).await;
            assert_eq!((seq_of(&a), seq_of(&b)), (Some(i), Some(i + 1)), "{enc:?}");
            match a {
                Delivery::Batch(m) => assert_eq!(m.batch, batch(i)),
                Delivery::Resync => unreachable!(),
            }
            let [batches, gaps, replayed, resyncs, bad] = stats.snapshot();
            assert_eq!(batches, i + 2);
            assert_eq!(
                gaps, 1,
                "only the lost batch is a gap (the late join is not)"
            );
            assert!(
                replayed > 3,
                "the 3 before the join and the lost one: {replayed}"
            );
            assert_eq!((resyncs, bad), (0, 0));
        }
    });
}

#[test]
fn a_gap_nothing_can_fill_is_a_counted_resync() {
    rt().block_on(async {
        // A replay buffer of 2: losing 3 in a row cannot be repaired.
        let mut p = Publisher::bind(
            "tcp://127.0.0.1:0",
            Some("tcp://127.0.0.1:0"),
            "kv",
            2,
            Encoding::TaggedMap,
        )
        .await
        .unwrap();
        let (mut rx, stats) = connected(&mut p, true).await;
        let mut i = 0;
        let mut last = loop {
            p.publish(&batch(i)).await.unwrap();
            i += 1;
            if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
                break seq_of(&d);
            }
        };
        // Up to the newest (the first delivery may be it, or a late join's replay or resync).
        while last != Some(i - 1) {
            last = seq_of(&next(&mut rx).await);
        }
        let [_, gaps0, _, resyncs0, _] = stats.snapshot();
        for k in 0..3 {
            p.lose_next(&batch(i + k));
        }
        p.publish(&batch(i + 3)).await.unwrap();
        assert_eq!(next(&mut rx).await, Delivery::Resync);
        assert_eq!(seq_of(&next(&mut rx).await), Some(i + 3));
        let [_, gaps, _, resyncs, _] = stats.snapshot();
        assert_eq!((gaps - gaps0, resyncs - resyncs0), (1, 1));

        // Without a replay endpoint a lost batch is a resync too.
        let mut q = Publisher::bind("tcp://127.0.0.1:0", None, "kv", 10, Encoding::TaggedArray)
            .await
            .unwrap();
        let (mut rx, stats) = connected(&mut q, false).await;
        let mut last = 0;
        loop {
            last = q.publish(&batch(last)).await.unwrap();
            if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
                break;
            }
        }
        // Drain to the newest, then lose one.
        while tokio::time::timeout(Duration::from_millis(200), rx.recv())
            .await
            .is_ok()
        {}
        let before = stats.snapshot()[3];
        q.lose_next(&batch(last + 1));
        let s = q.publish(&batch(last + 2)).await.unwrap();
        assert_eq!(next(&mut rx).await, Delivery::Resync);
        assert_eq!(seq_of(&next(&mut rx).await), Some(s));
        assert_eq!(stats.snapshot()[3], before + 1);
    });
}

#[test]
fn a_restarted_publisher_and_garbage_are_handled() {
    rt().block_on(async {
        // A raw PUB socket plays a publisher that sends garbage, then restarts its numbering.
        use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};
        let mut raw = PubSocket::new();
        let ep = raw.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let stats = Arc::new(SubscriberStats::default());
        tokio::spawn(subscribe(ep, None, "kv".into(), tx, stats.clone()));
        let frames = |seq: u64| {
            let f = cacheroute::telemetry::kv_events::encode_frames(
                b"kv",
                seq,
                &batch(seq),
                Encoding::TaggedMap,
            );
            ZmqMessage::try_from(f.into_iter().map(bytes::Bytes::from).collect::<Vec<_>>()).unwrap()
        };
        // Wait for the connection with seq 0 probes (each a first batch: no gap).
        loop {
            raw.send(frames(0)).await.unwrap();
            if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
                break;
            }
        }
        while tokio::time::timeout(Duration::from_millis(200), rx.recv())
            .await
            .is_ok()
        {}
        let before = stats.snapshot()[3];
        raw.send(frames(1)).await.unwrap();
        assert_eq!(seq_of(&next(&mut rx).await), Some(1));
        // Garbage: a message of two frames, then a payload that is not msgpack.
        raw.send(
            ZmqMessage::try_from(vec![bytes::Bytes::from("kv"), bytes::Bytes::from("x")]).unwrap(),
        )
        .await
        .unwrap();
        raw.send(
            ZmqMessage::try_from(vec![
                bytes::Bytes::from("kv"),
                bytes::Bytes::from(2u64.to_be_bytes().to_vec()),
                bytes::Bytes::from(vec![0x92, 0xcb]),
            ])
            .unwrap(),
        )
        .await
        .unwrap();
        // The numbering starts again: a restart.
        raw.send(frames(0)).await.unwrap();
        assert_eq!(next(&mut rx).await, Delivery::Resync);
        assert_eq!(seq_of(&next(&mut rx).await), Some(0));
        let s = stats.snapshot();
        assert_eq!(s[4], 2, "both garbage messages counted: {s:?}");
        assert_eq!(s[3], before + 1);
    });
}
