"""The Lightning Thunder compiler for litgpt: Fabric strategies (`strategies`), a pretraining entry point (`pretrain`)
and what lets Thunder 0.2.6 run on newer torch releases (`compat`). See README.md.

Importing this package imports neither thunder nor its strategies; they load when a run asks for them.
"""
