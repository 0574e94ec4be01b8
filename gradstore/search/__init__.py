"""Search over stored rows: the scoring scans a method's space runs per shard (:mod:`.scan_tasks`), attribution
indexes (a fitted preconditioner plus an exact or FAISS top-k structure, :mod:`.index`) and two-stage re-ranking
(:mod:`.rerank`)."""
