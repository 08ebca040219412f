"""Tools built on :func:`relprop.explain` and the captured graph, in the layer of the evaluation.

===========================  ==========================================================================
module                       job
===========================  ==========================================================================
``demo``                     the offline demo: all-MiniLM-L6-v2 as a zero-shot text classifier
                             (``relprop.demo``, ``relprop demo``)
``activation_maximization``  the input that maximizes one unit of the model
                             (:func:`relprop.maximize_activation`, ``relprop visualize``)
===========================  ==========================================================================
"""
