"""Tensor parallelism: N rank processes replaying the same submissions over ``torch.distributed``.

``group.py``       rank 0's side: start the ranks, the process group, the per-submission broadcast;
``rendezvous.py``  where ranks meet and how they prove they belong (store, secret, wake channels);
``rank_worker.py`` ranks 1..N-1 (``python -m ignition.runtime.parallel.rank_worker``).
"""
