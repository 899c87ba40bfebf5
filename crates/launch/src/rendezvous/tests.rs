//! The store end to end on loopback: every operation, timeouts that name their keys,
//! a server that goes away, and peers that do not speak the protocol.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, ST_ERROR};
use super::{RendezvousError, TcpStore};

const T: Duration = Duration::from_secs(5);

fn server(world: usize) -> (TcpStore, String) {
    let s = TcpStore::server("127.0.0.1:0", world, T).unwrap();
    let addr = s.local_addr().unwrap().to_string();
    (s, addr)
}

#[test]
fn set_get_check_delete_add() {
    let (s, addr) = server(2);
    let c = TcpStore::client(&addr, T).unwrap();
    assert_eq!(c.world_size(), 2);
    assert!(s.is_server() && !c.is_server());
    s.set("a", b"hello").unwrap();
    assert_eq!(c.get("a").unwrap(), b"hello");
    c.set("a", b"").unwrap();
    assert_eq!(s.get("a").unwrap(), b"");
    assert!(c.check(&["a"]).unwrap());
    assert!(!c.check(&["a", "b"]).unwrap());
    assert!(c.check::<&str>(&[]).unwrap());
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -2).unwrap(), 3);
    assert_eq!(c.get("n").unwrap(), b"3");
    assert!(c.delete_key("n").unwrap());
    assert!(!c.delete_key("n").unwrap());
    let big = vec![0xabu8; 1 << 20];
    c.set("big", &big).unwrap();
    assert_eq!(s.get("big").unwrap(), big);
}

#[test]
fn add_on_non_counter_is_a_server_error_and_store_stays_usable() {
    let (s, _) = server(1);
    s.set("text", b"abc").unwrap();
    let e = s.add("text", 1).unwrap_err();
    assert!(matches!(e, RendezvousError::Server { .. }), "{e}");
    assert!(e.to_string().contains("\"text\""), "{e}");
    assert_eq!(s.add("ok", 1).unwrap(), 1);
}

#[test]
fn many_threads_add_get_wait_barrier() {
    let world = 6;
    let (s, addr) = server(world);
    thread::scope(|sc| {
        for r in 0..world {
            let addr = addr.clone();
            let s = &s;
            sc.spawn(move || {
                let own;
                let c = if r == 0 {
                    s
                } else {
                    own = TcpStore::client(&addr, T).unwrap();
                    &own
                };
                // Wait before anyone may have set: the server wakes us.
                let keys: Vec<String> = (0..world).map(|i| format!("v/{i}")).collect();
                c.set(&format!("v/{r}"), format!("{}", r * 10).as_bytes()).unwrap();
                c.wait(&keys, T).unwrap();
                let sum: usize = (0..world)
                    .map(|i| {
                        let v = c.get(&format!("v/{i}")).unwrap();
                        String::from_utf8(v).unwrap().parse::<usize>().unwrap()
                    })
                    .sum();
                assert_eq!(sum, 10 * world * (world - 1) / 2);
                for _ in 0..20 {
                    c.add("counter", 1).unwrap();
                }
                c.barrier("counted").unwrap();
                assert_eq!(c.get("counter").unwrap(), (20 * world).to_string().into_bytes());
                // Reusing a barrier name joins its next round.
                c.barrier("counted").unwrap();
                c.barrier("counted").unwrap();
            });
        }
    });
}

#[test]
fn get_timeout_names_the_key() {
    let (s, _) = server(1);
    let t0 = Instant::now();
    let e = s.get_timeout("nccl_id/tp", Duration::from_millis(200)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(matches!(e, RendezvousError::Timeout { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains("nccl_id/tp") && m.contains("200ms") && m.contains("get"), "{m}");
    // The connection is still in step after a server-side timeout.
    s.set("x", b"1").unwrap();
    assert_eq!(s.get("x").unwrap(), b"1");
}

#[test]
fn wait_timeout_names_only_missing_keys() {
    let (s, _) = server(1);
    s.set("here", b"").unwrap();
    let e = s.wait(&["here", "absent"], Duration::from_millis(100)).unwrap_err();
    match &e {
        RendezvousError::Timeout { keys, op, .. } => {
            assert_eq!(keys, &["absent".to_string()]);
            assert_eq!(*op, "wait");
        }
        _ => panic!("{e}"),
    }
}

#[test]
fn barrier_timeout_says_who_arrived() {
    let (s, _) = server(3);
    let e = s.barrier_timeout("init", Duration::from_millis(100)).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("\"init\"") && m.contains("1 of 3"), "{m}");
}

#[test]
fn client_to_closed_port_errors_within_timeout() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let e = TcpStore::client(&addr, Duration::from_millis(300)).unwrap_err();
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(2), "{took:?}");
    assert!(matches!(e, RendezvousError::Connect { attempts, .. } if attempts > 1), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
}

#[test]
fn client_retries_until_server_starts() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let late = thread::spawn({
        let addr = addr.clone();
        move || {
            thread::sleep(Duration::from_millis(200));
            TcpStore::server(&addr, 2, T)
        }
    });
    let c = TcpStore::client(&addr, T).unwrap();
    let s = late.join().unwrap().unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(s.get("k").unwrap(), b"v");
}

#[test]
fn server_dropped_mid_wait_is_an_error_not_a_hang() {
    let (s, addr) = server(2);
    let c = TcpStore::client(&addr, Duration::from_secs(30)).unwrap();
    let waiter = thread::spawn(move || {
        let t0 = Instant::now();
        (c.get("never"), t0.elapsed(), c)
    });
    thread::sleep(Duration::from_millis(150));
    drop(s);
    let (r, took, c) = waiter.join().unwrap();
    let e = r.unwrap_err();
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(matches!(e, RendezvousError::ServerGone { .. }), "{e}");
    assert!(e.to_string().contains("never"), "{e}");
    // Later use reports the closed connection.
    assert!(matches!(c.set("a", b""), Err(RendezvousError::Closed { .. })));
}

#[test]
fn server_answers_satisfied_barrier_before_shutdown() {
    // The hosting rank drops its store right after its barrier returns;
    // the other ranks must still get their answer.
    for _ in 0..20 {
        let (s, addr) = server(4);
        let clients: Vec<_> = (1..4).map(|_| TcpStore::client(&addr, T).unwrap()).collect();
        let hs: Vec<_> =
            clients.into_iter().map(|c| thread::spawn(move || c.barrier("exit"))).collect();
        s.barrier("exit").unwrap();
        drop(s);
        for h in hs {
            h.join().unwrap().unwrap();
        }
    }
}

#[test]
fn malformed_and_foreign_peers_get_typed_errors() {
    // A server that is not a tpar store.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let junk = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
    });
    let e = TcpStore::client(&addr, Duration::from_secs(2)).unwrap_err();
    assert!(matches!(e, RendezvousError::Protocol { .. }), "{e}");
    junk.join().unwrap();

    // A client sending garbage gets an error reply, and the server lives on.
    let (s, addr) = server(1);
    let mut raw = TcpStream::connect(&addr).unwrap();
    write_frame(&mut raw, &[42, 1, 2]).unwrap();
    let reply = match read_frame(&mut raw) {
        Ok(b) => b,
        Err(_) => panic!("no reply"),
    };
    assert_eq!(reply[0], ST_ERROR);
    raw.write_all(&u32::MAX.to_be_bytes()).ok();
    s.set("still", b"alive").unwrap();
    assert_eq!(s.get("still").unwrap(), b"alive");
}
