//! The analyzer's work on the machine's cores: how many threads, and a map over items on them.

/// The threads the analyzer runs its work on: the machine's cores, at most 8.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// `f` over `items` on the machine's cores (at most 8 threads, each a contiguous share of the
/// items), the results in the items' order: the per-pCPU work after decoding (joining the
/// lists, indexing them), which would otherwise run on one core.
pub fn par_map<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let threads = cores().min(items.len());
    if threads <= 1 {
        return items.into_iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let mut groups: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut items = items.into_iter();
    loop {
        let group: Vec<T> = items.by_ref().take(per).collect();
        if group.is_empty() {
            break;
        }
        groups.push(group);
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| s.spawn(move || g.into_iter().map(f).collect::<Vec<R>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// `f` over `items` on the machine's cores (at most 8 threads), each thread taking the next item
/// as it becomes free, the results in the items' order: for items of uneven sizes (a contiguous
/// share each, as [`par_map`] gives, leaves one thread with the large ones). The caller puts
/// the largest first.
pub fn par_map_queue<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let threads = cores().min(items.len());
    if threads <= 1 {
        return items.into_iter().map(f).collect();
    }
    let items: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let results: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            // Each item is taken once (its number is handed out once), so no lock is contended;
            // a poisoned lock means a panic, which the scope passes on.
            let item = item.lock().ok().and_then(|mut t| t.take());
            if let Some(item) = item {
                let r = f(item);
                if let Ok(mut slot) = results[i].lock() {
                    *slot = Some(r);
                }
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(work);
        }
        work();
    });
    results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .ok()
                .flatten()
                .expect("every item was mapped (a worker's panic is passed on by the scope)")
        })
        .collect()
}
