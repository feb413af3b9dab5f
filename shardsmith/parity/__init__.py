"""``shardsmith parity``: is a difference between TP configurations rounding noise or a defect?

=====================  ==========================================================================
module                 what
=====================  ==========================================================================
:mod:`.run`            configurations (packs split on the fly, a given pack, transformers), the run
:mod:`.ranks`          one configuration on its own ranks (rank 0 drives, the others follow)
:mod:`.collect`        rank 0's records through forward hooks: greedy steps, reference prefill, layers
:mod:`.reference`      transformers' model as a configuration
:mod:`.compare`        first divergence, the noise estimate and the verdict (pure functions)
:mod:`.report`         JSON and Rich tables
=====================  ==========================================================================
"""
