"""merger/engine"""
