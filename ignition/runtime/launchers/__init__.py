"""The prepared Triton launches of a core, bound per core and launched through the CUDA driver
(runtime/cuda_driver.py), never compiled at run time.

``launches.py``   the kernel table, target selection and the launch loop every launcher shares;
``reduction.py``  the single-rank logprob reduction (``PreparedReduction``) and ``load_launcher``;
``vocabulary.py`` the vocabulary-sharded generation and prompt-scoring stages (``PreparedVocabulary``).
"""
